"""The trainer's checkpoints: when one is due, what goes into one, when it is written in the
background, what the loop waited for it, and going back to one (rollback, verify_on_start).

The loop says only `saves.after_step(step, last)` (and `saves.stop(step)` on a preemption);
this class decides whether a checkpoint is due (checkpoint.every, the last step, a stop),
flushes the metrics first (so metrics.jsonl holds every step a checkpoint holds) and keeps
the hang watchdog out of the wait. A checkpoint's trainer state is the loop's position, the
engine's own part, and what the run's other collaborators report of themselves (`about`:
the layout, the model, the data, the non-finite guard's counters), each its own part.

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
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain import checkpoint
from scaletrain.checkpoint.manager import PendingSave
from scaletrain.checkpoint.neutral import ParamLayout
from scaletrain.checkpoint.state import TrainerState
from scaletrain.config import Config
from scaletrain.engines import Engine
from scaletrain.launch.distributed import World, barrier
from scaletrain.resilience.nonfinite import Diverged
from scaletrain.telemetry import MetricsLog
from scaletrain.training.rundir import RunPaths

# How long a rank that must leave at once (out of memory) lets the save in flight complete.
LET_FINISH_S = 120.0


@dataclass
class Saves:
    cfg: Config
    world: World
    engine: Callable[[], Engine]  # the run's, held by the run alone (training/trainer.py)
    paths: RunPaths
    metrics: MetricsLog
    layout: ParamLayout
    # TrainerState's fields that the run's other collaborators report of themselves (world_size,
    # parallel, model, data_fingerprint, nonfinite, base): each part called at every save.
    about: list[Callable[[], dict[str, Any]]]
    position: Callable[[], int]  # the data position where the next step starts
    before_save: Callable[[], None]  # flush the metrics of the steps a checkpoint will hold
    paused: Callable[[], AbstractContextManager[Any]]  # the hang watchdog left out of long waits
    say: Callable[[str], None]
    writes: bool = True  # False: replica groups other than group 0 write no checkpoint (resilience/replica_groups.py)
    tokenizer: Path | None = None  # the data's, copied into checkpoint.hf_every's directories
    # The save in flight: it, when it started, how long the loop stood still, of which waiting for the one before.
    _pending: tuple[PendingSave, float, float, float] | None = field(default=None, init=False)
    _saved: int = field(default=0, init=False)  # the step of the last checkpoint this run wrote
    _verify: bool = field(default=False, init=False)  # checkpoint.verify_on_start still to do
    _exported: list[dict[str, Any]] = field(default_factory=list, init=False)  # checkpoint.hf_every's rows to log
    _mirror: Callable[[Path], Any] = field(default_factory=lambda: lambda path: None, init=False)  # checkpoint.dir's copy

    def __post_init__(self) -> None:
        # After the first step: torch creates optimizer state lazily, and saving before it
        # exists would create it early (shifting Adam's step count).
        self._verify = self.cfg.checkpoint.verify_on_start
        if self.world.is_main:
            from scaletrain.checkpoint.remote import after_save

            self._mirror = after_save(self.cfg.checkpoint.dir, self.cfg.checkpoint.keep)

    def due(self, step: int, last: bool) -> bool:
        """Whether after_step will write (or verify) a checkpoint at `step`."""
        return self.writes and self._scheduled(step, last) or self._verify

    def _scheduled(self, step: int, last: bool) -> bool:
        c = self.cfg.checkpoint
        return last or (c.every > 0 and step % c.every == 0) or self._hf(step, last)

    def _hf(self, step: int, last: bool) -> bool:
        """Whether `step`'s checkpoint is exported as Hugging Face weights (checkpoint.hf_every, hf_last)."""
        c = self.cfg.checkpoint
        return (c.hf_every > 0 and step % c.hf_every == 0) or (last and c.hf_last)

    def after_step(self, step: int, last: bool, tokens_seen: int) -> None:
        """Collective: the checkpoint of `step` if one is due (checkpoint.every, hf_every, or
        `last`); then the round trip of verify_on_start if still to do; logs a finished background save."""
        if self._scheduled(step, last):
            self._save_now(step, tokens_seen, self._hf(step, last))
        self.poll()
        if self._verify:
            self._verify = False
            with self.paused():
                self.verify_round_trip(step, self.position(), tokens_seen)
            self.say(f"checkpoint: verify_on_start saved and reloaded step {step}: every tensor came back exactly")

    def stop(self, step: int, tokens_seen: int) -> None:
        """Collective, on a preemption: the checkpoint where the run stopped, complete."""
        if self._saved != step:
            self._save_now(step, tokens_seen)
        with self.paused():
            self.wait()

    def _save_now(self, step: int, tokens_seen: int, hf: bool = False) -> None:
        if not self.writes:
            return
        self.before_save()
        with self.paused():  # a long save (or the wait for the previous one) is no hang
            self.save(step, self.position(), tokens_seen, hf)
        self._saved = step

    def save(self, step: int, position: int, tokens_seen: int, hf: bool = False) -> None:
        """Collective: the checkpoint of `step` (in the background if configured), and with
        `hf` its Hugging Face export once it is complete."""
        start = time.perf_counter()
        self.wait()  # one in flight: the next one's collectives share its group
        waited = time.perf_counter() - start
        target = checkpoint.step_dir(self.paths.checkpoints, step)
        pending = self._write(target, step, position, tokens_seen, True, hf)
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

    def let_finish(self, timeout_s: float = LET_FINISH_S) -> None:
        """Before this rank leaves without teardown (resilience/oom.py): the save in flight may still
        complete (its collectives run on a group of their own, beside training's), so that
        the work up to it is kept; an error or the timeout leaves it without its marker."""
        if self._pending is not None:
            self._pending[0].join(timeout_s)

    def roll_back(self) -> TrainerState:
        """Collective, train.nonfinite=rollback: the newest valid checkpoint back into the
        engine (weights, optimizer, loss scale, RNG); returns its trainer state. The data
        position is not restored: training goes on after the batches that failed."""
        engine = self.engine()
        with self.paused():
            self.wait()
            ckpt = checkpoint.latest_valid(self.paths.checkpoints, self.world, self.say)
            if ckpt is None:  # all damaged since the check: nothing to go back to
                raise Diverged("train.nonfinite=rollback: no valid checkpoint to roll back to; accepted: train.nonfinite=skip")
            state, _ = checkpoint.resume_state(ckpt, self.world, engine, self.layout, self._about()["parallel"])
        engine.load_extra_state(state.engine_state)
        return state

    def verify_round_trip(self, step: int, position: int, tokens_seen: int) -> None:
        """Collective, checkpoint.verify_on_start: save into a scratch directory, load it
        back natively, compare every tensor with the files (checkpoint.verify), remove it."""
        scratch = self.paths.checkpoints / ".verify_on_start"
        self._write(scratch, step, position, tokens_seen, background=False)
        engine = self.engine()
        checkpoint.load_checkpoint(scratch, self.world, lambda p: engine.load(p / "state"))
        checkpoint.verify(scratch, self.world, engine, self.layout)
        barrier(self.world)
        if self.world.is_main:
            shutil.rmtree(scratch)

    def _write(
        self, target: Path, step: int, position: int, tokens_seen: int, background: bool, hf: bool = False
    ) -> PendingSave | None:
        engine = self.engine()
        trainer_state = TrainerState(
            step=step,
            data_position=position,
            tokens_seen=tokens_seen,
            format=engine.format,
            engine=engine.name,
            engine_state=engine.extra_state(),
            **self._about(),
        )
        files = {"config.yaml": self.cfg.to_yaml(), **engine.checkpoint_files()}
        background = background and self.cfg.checkpoint.async_save
        keep, root, main = self.cfg.checkpoint.keep, self.paths.checkpoints, self.world.is_main
        # Pruning after the marker: until then the older checkpoints are the newest whole ones.
        prune = (lambda: checkpoint.prune(root, keep)) if main and target.parent == root else (lambda: None)
        # After the marker, before pruning (which may remove an older one, never this one):
        # the export reads the complete checkpoint from disk, the next save waits for it.
        export = (lambda: self._export_hf(target, step)) if main and hf else (lambda: None)
        # checkpoint.dir: the complete checkpoint copied to object storage (checkpoint/remote.py).
        mirror = (lambda: self._mirror(target)) if main and target.parent == root else (lambda: None)
        return checkpoint.save_checkpoint(
            target, self.world, lambda d: engine.save(d, background=background), trainer_state, files,
            then=lambda: (export(), mirror(), prune()),
        )  # fmt: skip

    def _export_hf(self, ckpt: Path, step: int) -> None:
        """Rank 0: `ckpt` as a Hugging Face directory, <run.dir>/hf/step_<N> (checkpoint/hf_export.py)."""
        from scaletrain.checkpoint.hf_export import export_checkpoint

        out = self.paths.root / "hf" / f"step_{step}"
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():  # a resumed run passing the same step again: that export is of these weights
            return
        start = time.perf_counter()
        done = export_checkpoint(ckpt, out, tokenizer=self.tokenizer)
        if self.cfg.checkpoint.dir:  # beside the checkpoints in object storage: <url>/hf/step_<N>, its index last
            from scaletrain.checkpoint.remote import CheckpointStore

            CheckpointStore(self.cfg.checkpoint.dir).upload(out, f"hf/{out.name}", last="model.safetensors.index.json")
        # Logged by the loop's thread with the save's own row (this may run in the save's).
        self._exported.append({"step": step, "event": "hf_export", "path": str(out), "bytes": done["bytes"],
                               "total_s": time.perf_counter() - start})  # fmt: skip

    def _about(self) -> dict[str, Any]:
        return {key: value for part in self.about for key, value in part().items()}

    def _event(self, step: int, background: bool, blocking: float, waited: float, total: float) -> None:
        row = {"step": step, "event": "checkpoint", "async": background, "blocking_s": blocking}
        exported, self._exported[:] = list(self._exported), []
        self.metrics.write([{**row, "waited_for_previous_s": waited, "total_s": total}, *exported])
