"""The trainer's checkpoints: what goes into one, when it is written in the background, what
the loop waited for it, and going back to one (rollback, verify_on_start).

With checkpoint.async_save (the default), a torch engine's save returns once the state is
copied to CPU memory; DCP writes it from a thread and a thread of ours then writes the
manifest and the COMPLETE marker (checkpoint/manager.py). One save is in flight at a time:
the next one, a rollback, a preemption and the end of the run wait for it first. Each save
leaves one event row in metrics.jsonl once it is complete:
  {"step": N, "event": "checkpoint", "async": bool, "blocking_s": how long the loop stood
   still (the copy, or the whole write when synchronous, plus any wait for the previous
   save), "waited_for_previous_s": that wait, "total_s": from the start to the marker}
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain import checkpoint
from scaletrain.checkpoint.frozen_base import base_reference
from scaletrain.checkpoint.manager import PendingSave
from scaletrain.checkpoint.neutral import ParamLayout
from scaletrain.config import Config
from scaletrain.data import PackedTokens
from scaletrain.distributed import World, barrier
from scaletrain.engines import Engine
from scaletrain.models import ModelSpec
from scaletrain.nonfinite import Diverged, NonfiniteGuard
from scaletrain.parallel import ParallelDims
from scaletrain.rundir import RunPaths
from scaletrain.telemetry import MetricsLog


@dataclass
class Saves:
    cfg: Config
    world: World
    dims: ParallelDims
    engine: Engine
    spec: ModelSpec
    data: PackedTokens
    paths: RunPaths
    guard: NonfiniteGuard
    metrics: MetricsLog
    layout: ParamLayout
    # The save in flight: it, when it started, how long the loop stood still, of which waiting for the one before.
    _pending: tuple[PendingSave, float, float, float] | None = field(default=None, init=False)

    def save(self, step: int, position: int, tokens_seen: int) -> None:
        """Collective: the checkpoint of `step` (in the background if configured)."""
        start = time.perf_counter()
        self.wait()  # one in flight: the next one's collectives share its group
        waited = time.perf_counter() - start
        pending = self._write(checkpoint.step_dir(self.paths.checkpoints, step), step, position, tokens_seen, True)
        blocking = time.perf_counter() - start
        if pending is None:
            self._event(step, False, blocking, waited, blocking)
        else:
            self._pending = (pending, start, blocking, waited)

    def newest(self) -> Path | None:
        """The newest complete checkpoint, once the one in flight is done."""
        self.wait()
        return checkpoint.latest_complete(self.paths.checkpoints)

    def poll(self) -> None:
        """Once per step: log a background save that has finished (its errors surface here)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Until the save in flight, if any, is complete (marker written); raises its error."""
        if self._pending is None:
            return
        pending, start, blocking, waited = self._pending
        self._pending = None
        pending.wait()
        self._event(pending.step, True, blocking, waited, pending.finished - start)

    def roll_back(self, say: Any) -> tuple[int, int]:
        """Collective, train.nonfinite=rollback: the newest valid checkpoint back into the
        engine (weights, optimizer, loss scale, RNG); returns its step and token count. The
        data position is not restored: training goes on after the batches that failed."""
        self.wait()
        ckpt = checkpoint.latest_valid(self.paths.checkpoints, self.world, say)
        if ckpt is None:  # all damaged since the check: nothing to go back to
            raise Diverged("train.nonfinite=rollback: no valid checkpoint to roll back to; accepted: train.nonfinite=skip")
        trainer_state, _ = checkpoint.resume_state(ckpt, self.world, self.engine, self.layout, self.dims.as_dict())
        self.engine.load_extra_state(trainer_state["engine_state"])
        say(self.guard.rolled_back(trainer_state["step"]))
        return trainer_state["step"], trainer_state["tokens_seen"]

    def verify_round_trip(self, step: int, position: int, tokens_seen: int) -> None:
        """Collective, checkpoint.verify_on_start: save into a scratch directory, load it
        back natively, compare every tensor with the files (checkpoint.verify), remove it."""
        scratch = self.paths.checkpoints / ".verify_on_start"
        self._write(scratch, step, position, tokens_seen, background=False)
        checkpoint.load_checkpoint(scratch, self.world, lambda p: self.engine.load(p / "state"))
        checkpoint.verify(scratch, self.world, self.engine, self.layout)
        barrier(self.world)
        if self.world.is_main:
            shutil.rmtree(scratch)

    def _write(self, target: Path, step: int, position: int, tokens_seen: int, background: bool) -> PendingSave | None:
        engine = self.engine
        trainer_state = {
            "step": step,
            "data_position": position,  # the global sample index where step+1 starts
            "tokens_seen": tokens_seen,
            "world_size": self.world.world_size,
            "parallel": self.dims.as_dict(),
            "scheduler": {"name": "warmup_cosine", "step": step},
            # What state/ is and what it fits: read on resume before anything is allocated.
            "format": engine.format,
            "engine": engine.name,
            "model": self.spec.config(),
            "data_fingerprint": self.data.fingerprint,
            "engine_state": engine.extra_state(),
            "nonfinite": self.guard.counters(),
        }
        if self.cfg.checkpoint.frozen == "reference":  # the frozen parameters are not in state/: where they come from
            trainer_state["base"] = base_reference(self.cfg)
        files = {"config.yaml": self.cfg.to_yaml(), **engine.checkpoint_files()}
        background = background and self.cfg.checkpoint.async_save
        keep, root, main = self.cfg.checkpoint.keep, self.paths.checkpoints, self.world.is_main
        # Pruning after the marker: until then the older checkpoints are the newest whole ones.
        prune = (lambda: checkpoint.prune(root, keep)) if main and target.parent == root else (lambda: None)
        return checkpoint.save_checkpoint(
            target, self.world, lambda d: engine.save(d, background=background), trainer_state, files, then=prune
        )

    def _event(self, step: int, background: bool, blocking: float, waited: float, total: float) -> None:
        row = {"step": step, "event": "checkpoint", "async": background, "blocking_s": blocking}
        self.metrics.write([{**row, "waited_for_previous_s": waited, "total_s": total}])
