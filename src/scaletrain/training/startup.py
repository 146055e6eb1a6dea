"""The pieces training/trainer.py's `start` builds a run from, each on its own: the run's
directories and disks, the checkpoint it resumes, what it is (its identity in every
checkpoint), the engine's one holder, and the small callables its collaborators are handed
(a line for the log, the metrics flushed) as objects rather than closures over the trainer."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from scaletrain import checkpoint
from scaletrain.checkpoint.disks import check_disks, checkpoints_root, find_disks
from scaletrain.checkpoint.frozen_base import base_reference
from scaletrain.checkpoint.remote import bring_back, check_store, same_everywhere
from scaletrain.config import Config
from scaletrain.config.parallel import ParallelDims, dims_for
from scaletrain.data import (
    DataMix,
    PackedTokens,
    ensure_prepared,
    mix_to_prepare,
    open_mix,
    prepare_mix,
    resolve_dataset_dir,
)
from scaletrain.data.remote import store_options
from scaletrain.engines import Engine
from scaletrain.errors import UserError
from scaletrain.launch.distributed import World, barrier, rank0_first
from scaletrain.models import ModelSpec
from scaletrain.resilience.replica_groups import group_dir
from scaletrain.telemetry import TrainProgress
from scaletrain.telemetry.session import Telemetry
from scaletrain.training.paths import make_dir
from scaletrain.training.rundir import RunPaths, branch_cooldown, resume_point


class Held:
    """The run's engine, held here alone: collaborators reach it through `engine` or `model`
    (bound methods), so that `release` lets it go for all of them (a DDP wrapper must not
    outlive the process group: see train())."""

    def __init__(self, engine: Engine):
        self._engine: Engine | None = engine

    def engine(self) -> Engine:
        assert self._engine is not None, "the run's engine was released"
        return self._engine

    def model(self) -> Any:
        return self.engine().model

    def release(self) -> None:
        self._engine = None


class Say:
    """A line for the log: on rank 0 (`main`) to the console, or (console None) to stderr on every rank."""

    def __init__(self, console: Console | None, main: bool):
        self.console, self.main = console, main

    def __call__(self, line: str) -> None:
        if self.console is None:
            print(line, file=sys.stderr, flush=True)
        elif self.main:
            self.console.print(line, highlight=False, soft_wrap=True)


class Flush:
    """The metrics of the steps so far read, reviewed and shown (before a save, an evaluation)."""

    def __init__(self, telemetry: Telemetry, progress: TrainProgress):
        self.telemetry, self.progress = telemetry, progress

    def __call__(self) -> None:
        self.progress.show(self.telemetry.flush())


class Unmade:
    """An exit callback: the directories this start made, removed again when the start stops
    on a one-line error and they are still empty (bad input leaves nothing written)."""

    def __init__(self, made: list[Path]):
        self.made = made  # deepest first

    def __call__(self, kind: type[BaseException] | None, *_: Any) -> None:
        if kind is None or not issubclass(kind, UserError):
            return
        for path in self.made:
            try:
                path.rmdir()  # only if empty; another rank may have removed it already
            except OSError:
                return


def directories(cfg: Config, world: World, say: Say, stack: ExitStack) -> tuple[RunPaths, Any]:
    """The run's directories, checked on every rank (the same verdict everywhere), and which
    ranks share a disk; with object storage, its newest checkpoint brought back onto each disk.
    The directories made here go again if the start stops on bad input (Unmade)."""
    dims_for(cfg.parallel, world.world_size)  # a bad layout stops here, before any work
    wanted = group_dir(cfg, Path(cfg.run.dir).expanduser()).absolute() if "://" not in cfg.run.dir else None
    made = [p for p in ([wanted, *wanted.parents] if wanted else []) if not p.exists()]
    stack.push(Unmade(made))
    root = group_dir(cfg, make_dir(cfg.run.dir, "run.dir"))
    paths = RunPaths(root, checkpoints_root(root, world))
    paths.root.mkdir(parents=True, exist_ok=True)
    if "nvme" in (cfg.parallel.offload_optimizer, cfg.parallel.offload_params) and cfg.parallel.nvme_path:
        make_dir(cfg.parallel.nvme_path, "parallel.nvme_path")
    if cfg.checkpoint.dir:
        check_store(cfg.checkpoint.dir)
    disks = find_disks(paths.checkpoints, world)  # nodes without a shared disk need checkpoint.dir
    check_disks(disks, cfg.checkpoint.dir, cfg.run.dir)
    if cfg.checkpoint.dir and cfg.train.resume == "auto":
        if disks.leader:
            bring_back(cfg.checkpoint.dir, paths.checkpoints, say)
        barrier(world)
        if not disks.shared:
            same_everywhere(paths.checkpoints, world)
    return paths, disks


def checkpoint_to_resume(cfg: Config, world: World, paths: RunPaths, say: Say) -> tuple[Config, Path | None]:
    """The newest whole checkpoint to resume (None: a fresh start); a cooldown's branch."""
    resume_from = resume_point(cfg.train.resume, paths, world, say)
    if cfg.train.cooldown_steps is not None and resume_from is not None:
        cfg, line = branch_cooldown(cfg, resume_from, paths.root)
        say(line)
        # A branch that was stopped goes on from its own newest checkpoint, not from the origin again.
        resume_from = checkpoint.latest_valid(paths.checkpoints, world, say) or resume_from
    if resume_from is not None:
        cfg = _keep_held_out(cfg, resume_from, say)
    return cfg, resume_from


def _keep_held_out(cfg: Config, resume_from: Path, say: Say) -> Config:
    """A resume where the user set no eval.split holds out what the checkpoint's run held out.

    eval.split's rule (0.01 when evaluating on held-out documents, else 0) follows this
    start's eval.every, but which documents training skips is part of the data position:
    `make demo` (eval.every=100) and then the README's `scaletrain train` (eval.every=0) would
    otherwise refuse to resume over a split nobody asked for. An eval.split the user gives,
    and a checkpoint that held nothing out, keep the check of checkpoint/resume.py."""
    if cfg.eval.split_given or cfg.eval.data:
        return cfg
    saved = (yaml.safe_load((resume_from / "config.yaml").read_text()) or {}).get("eval") or {}
    split = saved.get("split")
    if not isinstance(split, int | float) or not split > 0 or split == cfg.eval.split:
        return cfg
    kept = cfg.model_copy(deep=True)
    kept.eval.split = float(split)
    say(
        f"eval.split={split:g} as {resume_from.name} was trained: the documents it held out stay out (eval.every={cfg.eval.every})"
    )
    return kept


def identity(cfg: Config, world: World, dims: ParallelDims, spec: ModelSpec, data: PackedTokens | DataMix) -> dict[str, Any]:
    """What every checkpoint of this start records of the run besides the loop's position and
    the engine's state: the layout, the model, the data, and with checkpoint.frozen=reference
    where the frozen parameters (left out of state/) come from."""
    return {
        "world_size": world.world_size,
        "parallel": dims.as_dict(),
        "model": spec.config(),
        "data_fingerprint": data.fingerprint,
        "base": base_reference(cfg) if cfg.checkpoint.frozen == "reference" else None,
    }


def training_data(cfg: Config, world: World) -> PackedTokens | DataMix:
    """The run's training data: one prepared dataset (rank 0 prepares it, the others wait), or a mixture."""
    if not cfg.data.mix:
        return PackedTokens(
            _prepared_data(cfg, world),
            cfg.data.seq_len,
            cfg.train.seed,
            held_out=cfg.eval.held_out,
            store=store_options(cfg.data),
        )
    if mix_to_prepare(cfg.data):  # every rank judges every source's paths: the same error everywhere
        make_dir(cfg.data.dir, "data.dir", create=world.is_main)
    rank0_first(world, lambda: prepare_mix(cfg.data), "preparing the data", cfg.data.prepare_timeout_s, hint=_PREPARE_HINT)
    return open_mix(cfg.data, cfg.train.seed, held_out=cfg.eval.split or 0.0)


_PREPARE_HINT = "accepted: a larger data.prepare_timeout_s, or `scaletrain data prepare` beforehand and data.paths=<its output>"


def _prepared_data(cfg: Config, world: World) -> Path:
    # Every rank validates the paths (same error everywhere); rank 0 alone tokenizes.
    if resolve_dataset_dir(cfg.data)[1] is not None:  # to prepare, into the cache
        make_dir(cfg.data.dir, "data.dir", create=world.is_main)
    rank0_first(
        world,
        lambda: ensure_prepared(cfg.data, show_progress=True),
        "preparing the data",
        cfg.data.prepare_timeout_s,
        hint=_PREPARE_HINT,
    )
    return resolve_dataset_dir(cfg.data)[0]
