"""Checkpoints without the frozen parameters (checkpoint.frozen=reference).

A run that trains a subset (model.trainable) or adapters (model.lora) leaves most of the
model as it started: the weights at model.path, or the seeded init. Writing them into every
checkpoint costs the full model's disk and time for nothing. With `reference`, the engines
leave them out (DCP's `ignore_frozen_params`, DeepSpeed's `exclude_frozen_parameters`) and
trainer.json records the base instead:

  {"init_seed": S}                          built from the config with train.seed S
  {"path": DIR, "files": {name: [bytes, mtime_s]}}   Hugging Face weights from a directory

A resume builds the model as any start does (so the frozen parameters come from the base
again) and loads the trained state over it; it refuses a base whose weight files changed
since (`check_base`). An export rebuilds the base on the CPU for the tensors the checkpoint
does not hold (`base_weights`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from scaletrain.config import Config
from scaletrain.errors import UserError


def base_reference(cfg: Config) -> dict[str, Any]:
    """Where the frozen parameters of a run of `cfg` come from."""
    m = cfg.model
    if m.source == "hf" and m.path:
        from scaletrain.models.hf import weight_files

        directory = Path(m.path).expanduser().resolve()
        files = sorted(set(weight_files(directory).values()))
        # Bytes and whole-second modification times: a rewritten or re-downloaded file
        # changes them; a copy that keeps times (cp -p, rsync -a) at another path does not.
        stats = {f: (directory / f).stat() for f in files}
        return {"path": str(directory), "files": {f: [s.st_size, int(s.st_mtime)] for f, s in stats.items()}}
    return {"init_seed": cfg.train.seed}


def check_base(ckpt: Path, saved: dict[str, Any], cfg: Config) -> None:
    """A one-line UserError unless `cfg` rebuilds the base the checkpoint `ckpt` refers to."""
    now = base_reference(cfg)
    hint = "accepted: the base it was trained from, or a checkpoint saved with checkpoint.frozen=save"
    if "init_seed" in saved:
        if now != saved:
            raise UserError(
                f"checkpoint {ckpt} left its frozen parameters out and refers to the seeded init of train.seed="
                f"{saved['init_seed']}, but this run starts from {_describe(now)}; {hint}"
            )
        return
    if "files" not in now:
        raise UserError(f"checkpoint {ckpt} refers to the base weights at {saved['path']}, but model.path is not set; {hint}")
    if now["files"] != saved["files"]:
        changed = [f for f in sorted(set(now["files"]) | set(saved["files"])) if now["files"].get(f) != saved["files"].get(f)]
        raise UserError(
            f"the base weights at {now['path']} are not those checkpoint {ckpt} was trained on "
            f"({changed[0]} differs in name, size or time from {saved['path']}); {hint}"
        )


def _describe(ref: dict[str, Any]) -> str:
    return f"the weights at {ref['path']}" if "path" in ref else f"the seeded init of train.seed={ref['init_seed']}"


def base_weights(cfg: Config, spec: Any) -> dict[str, torch.Tensor]:
    """The base's parameters by canonical name, built on the CPU exactly as a run starts
    (one full fp32 copy in memory)."""
    from scaletrain.models.params import canonical_name

    if getattr(spec, "path", None) is None and cfg.model.source == "hf" and cfg.model.path:
        spec = replace(spec, path=cfg.model.path)  # a checkpoint's spec has no directory: its weights are saved
    model = spec.build_meta(cfg.data.seq_len)
    spec.materialize(model, torch.device("cpu"), cfg.train.seed)
    return {canonical_name(n): p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
