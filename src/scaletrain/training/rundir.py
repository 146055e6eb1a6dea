"""The run directory, the single source of truth about a run: where things go, which
checkpoint a run continues, whether it may, and run.json (what ran where)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from scaletrain import checkpoint
from scaletrain.checkpoint.resume import check_config
from scaletrain.config import Config, load_config
from scaletrain.config.batch import global_batch
from scaletrain.config.load import from_tree
from scaletrain.config.parallel import ParallelDims
from scaletrain.errors import UserError
from scaletrain.launch import forked
from scaletrain.launch.distributed import World, versions
from scaletrain.models import ModelSpec
from scaletrain.optim.registry import SCHEDULES
from scaletrain.optim.schedule import lr_at, scaled_lr, wsd_decay_steps
from scaletrain.strategies import said


@dataclass
class RunPaths:
    root: Path
    # <root>/checkpoints unless a drill gives this rank's node a disk of its own (checkpoint/disks.py)
    checkpoint_root: Path | None = None

    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_root or self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def run_info(self) -> Path:
        return self.root / "run.json"


def resume_point(resume: str, paths: RunPaths, world: World, report: Callable[[str], None]) -> Path | None:
    """Collective: the checkpoint this run continues (train.resume), or None for a fresh
    start. `auto` takes the newest whole one and reports each damaged one it skips."""
    if resume == "auto":
        return checkpoint.latest_valid(paths.checkpoints, world, report)
    latest = checkpoint.latest_complete(paths.checkpoints)
    if resume == "never":
        if latest is not None:
            raise UserError(
                f"train.resume=never but run.dir {paths.root} already holds checkpoints (newest {latest.name}); "
                "accepted: train.resume=auto to continue it, or another run.dir for a fresh run"
            )
        return None
    path = Path(resume)
    if not path.is_dir():
        raise UserError(
            f"train.resume={resume!r}: no such checkpoint directory; accepted: auto, never, or a checkpoints/step_<N> path"
        )
    if not checkpoint.is_complete(path):
        raise UserError(
            f"train.resume={resume!r} is an incomplete checkpoint (no {checkpoint.MARKER} marker); accepted: a complete one"
        )
    problem = checkpoint.find_problem(path, world)
    if problem:
        raise UserError(f"train.resume={resume!r} is damaged: {problem}; accepted: a whole checkpoint, or train.resume=auto")
    return path


def branch_cooldown(cfg: Config, origin: Path, root: Path) -> tuple[Config, str]:
    """train.cooldown_steps=N with train.resume=CKPT: a new run that continues CKPT's stable
    phase for nothing and decays at once, over N steps, as wsd's last N. Its settings are
    those of a straight wsd run of S + N steps (S: the checkpoint's) with train.decay_steps=N,
    so its numbers are that run's wherever the schedules coincide. Checked against the
    checkpoint's own run (one line): past its warmup, before its decay (a stable phase only
    wsd and constant have), and another run.dir, so that the original stays untouched."""
    if origin.resolve().parent.parent == root.resolve():
        raise UserError(
            f"train.cooldown_steps branches a new run from {origin}, and run.dir={root} is that checkpoint's own run; "
            "accepted: another run.dir (the original run stays untouched)"
        )
    step = checkpoint.TrainerState.read(origin).step
    try:
        before = load_config([str(origin / "config.yaml")]).train
    except UserError as e:
        raise UserError(f"train.cooldown_steps: {origin}'s config.yaml is unreadable here ({e})") from None
    where = f"{origin} (step {step} of a {before.schedule} schedule)"
    if not SCHEDULES[before.schedule].extendable:
        raise UserError(
            f"train.cooldown_steps branches from a stable phase, and {where} has none: its learning rate decays from "
            f"the warmup on; accepted: a checkpoint of a run with train.schedule="
            f"{said(tuple(n for n, s in SCHEDULES.items() if s.extendable))}"
        )
    if step < before.warmup_steps:
        raise UserError(
            f"train.cooldown_steps: {where} is still in its warmup ({before.warmup_steps} steps); accepted: a checkpoint past it"
        )
    last = SCHEDULES[before.schedule].decays_over == "last"
    decay_from = before.steps - wsd_decay_steps(before) if last else before.steps
    if step > decay_from:
        raise UserError(
            f"train.cooldown_steps: {where} is in its decay (from step {decay_from}); accepted: a checkpoint of its "
            f"stable phase, at step {decay_from} or before"
        )
    n = cfg.train.cooldown_steps
    assert n is not None
    tree = cfg.model_dump(exclude_unset=True)
    tree.setdefault("train", {}).update(steps=step + n, schedule="wsd", decay_steps=n)
    branched = from_tree(tree)
    t = branched.train
    line = (
        f"cooldown: from {where}: steps {step + 1}-{step + n} decay to train.lr x {t.min_lr_ratio:g} ({t.decay_shape}), "
        f"as wsd's last {n} of {step + n} steps; {origin.parent.parent} is left as it is"
    )
    return branched, line


def check_resume(path: Path, cfg: Config, model: ModelSpec, data_fingerprint: str, dp_size: int) -> list[str]:
    """Before anything is allocated: may this config continue `path`? One-line UserError if
    not (another engine's format, another model shape or data); else lines for the log,
    among them the learning rate the next step gets when the schedule's settings changed."""
    notes = []
    note = checkpoint.check_engine(path, cfg.parallel.strategy)
    if note:
        notes.append(note)
    saved = checkpoint.TrainerState.read(path)
    changes = check_config(path, cfg, saved, model.config(), data_fingerprint)
    if changes:
        notes.append(f"resume: changed since {path.name}: " + ", ".join(changes))
        notes += _lr_change(path, cfg, saved, dp_size)
    return notes


def _lr_change(path: Path, cfg: Config, saved: checkpoint.TrainerState, dp_size: int) -> list[str]:
    """The next step's learning rate under the checkpoint's settings and under these, when
    they differ: another train.steps re-shapes the cosine from here on (the schedule is a
    pure function of the step and the settings), which is right, and now said."""
    try:
        before = load_config([str(path / "config.yaml")]).train
    except UserError:  # written by another version: its schedule cannot be recomputed here
        return []
    old_batch = global_batch(before, int(saved.parallel.get("dp_size", saved.world_size)))
    new_batch = global_batch(cfg.train, dp_size)
    old = lr_at(saved.step, before, scaled_lr(before, old_batch))
    new = lr_at(saved.step, cfg.train, scaled_lr(cfg.train, new_batch))
    if math.isclose(old, new, rel_tol=1e-9):
        return []
    return [
        f"resume: the learning rate of step {saved.step + 1} is {new:.3e} ({old:.3e} under {path.name}'s settings): "
        "the warmup + cosine schedule continues from here with the new settings"
    ]


def write_run_info(
    paths: RunPaths,
    cfg: Config,
    world: World,
    dims: ParallelDims,
    hosts: list[str],
    resume_from: Path | None,
    device: dict[str, Any] | None = None,
) -> None:
    """run.json: what ran where, for tools and tests (the banner is for people)."""
    info: dict[str, Any] = {
        "engine": cfg.parallel.strategy,
        "world_size": world.world_size,
        "parallel": dims.as_dict(),
        "backend": world.backend,
        "device": world.device.type,
        "precision": cfg.precision,
        "hosts": hosts,  # by rank
        # How rank 0 came to be (a new Python, or forked from the launcher's agent:
        # launch/forked.py) and its intra-op threads: what a CPU run's speed depends on.
        "process_start": forked.process_start(),
        "cpu_threads": torch.get_num_threads(),
        "versions": versions(),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "resumed_from": str(resume_from) if resume_from else None,
        # The batch as run: the global batch stays, the micro-batch may have been chosen
        # (train.micro_batch=auto, the planner's search) or shrunk after an out-of-memory error.
        "batch": {
            "global_batch": cfg.train.global_batch,
            "micro_batch": cfg.train.micro_batch,
            "grad_accum": cfg.train.grad_accum,
            "choice": cfg.train.batch_choice,
        },
        **(device or {}),  # device_name, peak_flops (+ its source), flops_per_token, device_memory_bytes
    }
    checkpoint.write_atomic(paths.run_info, json.dumps(info, indent=1) + "\n")


def read_run_info(root: Path) -> dict[str, Any]:
    return json.loads((Path(root) / "run.json").read_text())
