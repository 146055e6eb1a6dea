"""What `scaletrain ckpt` does to a checkpoint: inspect, verify, convert, export. Imported
by ckpt.py once the command line is parsed (torch.distributed.checkpoint, the engines)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from scaletrain import checkpoint
from scaletrain.checkpoint.hf_export import dtype_note, export_checkpoint, export_target
from scaletrain.checkpoint.lora_export import export_adapter
from scaletrain.checkpoint.neutral import ParamLayout
from scaletrain.checkpoint.state import FILE, TrainerState
from scaletrain.config import Config, load_config
from scaletrain.data import tokens_dir
from scaletrain.data.prepare import TOKENIZER_FILE
from scaletrain.engines.convert import convert as convert_checkpoint
from scaletrain.errors import UserError
from scaletrain.launch.distributed import ALONE
from scaletrain.models import saved_spec
from scaletrain.planning.hardware import parse_size


def resolve(arg: str) -> Path:
    """A step directory as given, or a run directory's newest whole checkpoint."""
    path = Path(arg)
    if (path / FILE).is_file():
        if not checkpoint.is_complete(path):
            raise UserError(f"checkpoint {path} is incomplete (no {checkpoint.MARKER} marker); accepted: a complete one")
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = checkpoint.latest_valid(root, ALONE, lambda line: print(line))
    if found is None:
        raise UserError(f"{arg}: no checkpoint found; accepted: a checkpoints/step_<N> directory or a run directory holding one")
    return found


def inspect(args: argparse.Namespace) -> int:
    path = resolve(args.ckpt)
    saved = TrainerState.read(path)
    files = [f for f in path.rglob("*") if f.is_file()]
    info = {
        "path": str(path),
        "step": saved.step,
        "engine": saved.engine,
        "format": saved.format,
        "world_size": saved.world_size,
        "parallel": saved.parallel,
        "data_position": saved.data_position,
        "tokens_seen": saved.tokens_seen,
        "model": saved.model,
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
        "whole": checkpoint.find_problem(path, ALONE, checksums=False) or "yes (sizes; `ckpt verify` checks contents)",
        "engine_state": saved.engine_state,
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    for key, value in info.items():
        shown = json.dumps(value) if isinstance(value, dict) else value
        print(f"{key:14} {shown}")
    config = path / "config.yaml"
    if config.is_file():
        print("config (config.yaml):")
        print("  " + config.read_text().strip().replace("\n", "\n  "))
    return 0


def verify(args: argparse.Namespace) -> int:
    path = resolve(args.ckpt)
    problem = checkpoint.find_problem(path, ALONE)
    if problem:
        raise UserError(f"checkpoint {path} is damaged: {problem}")
    marker = json.loads((path / checkpoint.MARKER).read_text())
    files = marker.get("files")
    if files is None:
        print(f"{path}: complete, but written without a manifest: sizes and checksums cannot be checked")
        return 0
    total = sum(size for size, _ in files.values())
    print(f"{path}: ok, {len(files)} files, {total:,} bytes, sizes and CRC-32 checksums as saved")
    return 0


def convert(args: argparse.Namespace) -> int:
    src = resolve(args.src)
    dst = Path(args.dst)
    note = convert_checkpoint(src, dst, args.to, args.overrides)
    print(note)
    print(f"resume it with train.resume={dst} (at any world size), or put it under <run.dir>/checkpoints/")
    return 0


def export(args: argparse.Namespace) -> int:
    path = resolve(args.ckpt)
    saved = TrainerState.read(path)
    cfg = load_config([str(path / "config.yaml")])
    spec = saved_spec(saved.model)
    layout = ParamLayout(spec.build_meta(cfg.data.seq_len))
    if args.lora == "adapter":
        done = export_adapter(path, Path(args.out), layout, export_target(spec, cfg.data.seq_len), args.dtype)
        print(
            f"exported the LoRA adapters of {path} ({done['engine']}, step {saved.step}) to {args.out}: {done['tensors']} tensors, {args.dtype}"
        )
        return 0
    tokenizer = Path(args.tokenizer) if args.tokenizer else _run_tokenizer(cfg)
    if tokenizer is not None and not tokenizer.is_file():
        raise UserError(f"--tokenizer {tokenizer}: no such file; accepted: a tokenizer.json")
    shard_bytes = int(parse_size(args.max_shard_size, "--max-shard-size"))
    done = export_checkpoint(path, Path(args.out), args.dtype, args.trainable_only, tokenizer, shard_bytes)
    print(
        f"exported {path} ({done['engine']}, step {saved.step}) to {args.out}: {done['tensors']} tensors, "
        f"{done['bytes']:,} bytes in {done['files']} safetensors file(s), {dtype_note(args.dtype)}"
        + ("" if tokenizer else "; no tokenizer (the run's data is gone: pass --tokenizer)")
    )
    return 0


def _run_tokenizer(cfg: Config) -> Path | None:
    """The tokenizer.json of the run's prepared data, if that is still on disk."""
    try:
        found = tokens_dir(cfg.data) / TOKENIZER_FILE  # a mixture: its first source's, which all share
    except UserError:
        return None
    return found if found.is_file() else None


ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": inspect,
    "verify": verify,
    "convert": convert,
    "export": export,
}
