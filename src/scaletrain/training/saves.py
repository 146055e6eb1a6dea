"""The trainer's checkpoints: when one is due, what goes into one, when it is written in the
background, what the loop waited for it, and going back to one (rollback, verify_on_start).

The loop says only `saves.after_step(step, last)` (and `saves.stop(step)` on a preemption),
whose `_save` hands the engine's writer to checkpoint.save_checkpoint: the fourth call;
this class decides whether a checkpoint is due (checkpoint.every, the last step, a stop),
flushes the metrics first (so metrics.jsonl holds every step a checkpoint holds) and keeps
the hang watchdog out of the wait. A checkpoint's trainer state is the engine's own part and
the run's other collaborators' states (`parts`, training/state.py: the loop's position, what
the run is, the non-finite guard's counters, the experts' bias), each its own slice.

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
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from scaletrain import checkpoint
from scaletrain.checkpoint.disks import Disks, shared
from scaletrain.checkpoint.manager import PendingSave
from scaletrain.checkpoint.neutral import ParamLayout
from scaletrain.checkpoint.remote import CheckpointStore, StoreCopy, bring_back, clear_copied
from scaletrain.checkpoint.state import TrainerState
from scaletrain.config import Config
from scaletrain.engines import Engine
from scaletrain.errors import OutOfMemoryRestart, Preempted, UserError
from scaletrain.launch.distributed import World, barrier
from scaletrain.resilience.nonfinite import Diverged
from scaletrain.telemetry import MetricsLog
from scaletrain.training.rundir import RunPaths
from scaletrain.training.state import Stateful, state_of

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
    # The run's Stateful map (training/state.py): "position" (step, tokens_seen, data_position),
    # "identity" (world_size, parallel, model, data_fingerprint, base), the guard's, the bias'.
    parts: Mapping[str, Stateful]
    before_save: Callable[[], None]  # flush the metrics of the steps a checkpoint will hold
    paused: Callable[[], AbstractContextManager[Any]]  # the hang watchdog left out of long waits
    say: Callable[[str], None]
    writes: bool = True  # False: replica groups other than group 0 write no checkpoint (resilience/replica_groups.py)
    tokenizer: Path | None = None  # the data's, copied into checkpoint.hf_every's directories
    disks: Disks | None = None  # which ranks share a disk (checkpoint/disks.py); None: all of them
    # The save in flight: it, when it started, how long the loop stood still, of which waiting for the one before.
    _pending: tuple[PendingSave, float, float, float] | None = field(default=None, init=False)
    _saved: int = field(default=0, init=False)  # the step of the last checkpoint this run wrote
    _verify: bool = field(default=False, init=False)  # checkpoint.verify_on_start still to do
    _exported: list[dict[str, Any]] = field(default_factory=list, init=False)  # checkpoint.hf_every's rows to log
    _copy: StoreCopy | None = field(default=None, init=False)  # checkpoint.dir's (checkpoint/remote.py)

    def __post_init__(self) -> None:
        # After the first step: torch creates optimizer state lazily, and saving before it
        # exists would create it early (shifting Adam's step count).
        self._verify = self.cfg.checkpoint.verify_on_start
        self.disks = self.disks or shared(self.world)
        if self.cfg.checkpoint.dir:
            self._copy = StoreCopy(self.cfg.checkpoint.dir, self.cfg.checkpoint.keep, self.say)

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

    def after_step(self, step: int, last: bool) -> None:
        """Collective: the checkpoint of `step` if one is due (checkpoint.every, hf_every, or
        `last`); then the round trip of verify_on_start if still to do; logs a finished background save."""
        if self._scheduled(step, last):
            self._save(self._hf(step, last))
        self.poll()
        if self._verify:
            self._verify = False
            with self.paused():
                self.verify_round_trip()
            self.say(f"checkpoint: verify_on_start saved and reloaded step {step}: every tensor came back exactly")

    def stop(self, step: int) -> None:
        """Collective, on a preemption: the checkpoint where the run stopped, complete."""
        if self._saved != step:
            self._save()
        with self.paused():
            self.wait()

    def _save(self, hf: bool = False) -> None:
        """Collective: the checkpoint of the step the run stands at (in the background if
        configured), and with `hf` its Hugging Face export once it is complete. The engine's
        writer is called from checkpoint.save_checkpoint: the fourth call from the loop."""
        if not self.writes:
            return
        self.before_save()
        with self.paused():  # a long save (or the wait for the previous one) is no hang
            start = time.perf_counter()
            self.wait()  # one in flight: the next one's collectives share its group
            waited = time.perf_counter() - start
            state = state_of(self.parts)
            step = state["step"]
            target = checkpoint.step_dir(self.paths.checkpoints, step)
            background = self.cfg.checkpoint.async_save
            pending = checkpoint.save_checkpoint(
                target, self.world, partial(self.engine().save, background=background),
                **self._contents(target, state, self._hf_then(target, step, hf), self._copy),
            )  # fmt: skip
            blocking = time.perf_counter() - start
        if pending is None:
            self._event(step, False, blocking, waited, blocking)
        else:
            self._pending = (pending, start, blocking, waited)
        self._saved = step

    def wait_on_clean_stop(self, kind: type[BaseException] | None, error: BaseException | None, *_: Any) -> None:
        """An exit callback: a clean stop (the end, a preemption, a one-line error agreed by
        every rank, an out-of-memory restart) lets the checkpoint in flight complete; a crash
        does not wait for it (it stays without its marker). A run stopped by the non-finite
        guard is told which checkpoint is then the newest complete one, to go back to."""
        if kind is None or issubclass(kind, (UserError, Preempted, OutOfMemoryRestart)):
            self.wait()
        if isinstance(error, Diverged):
            error.locate(self.newest())

    def newest(self) -> Path | str | None:
        """The newest complete checkpoint, once the one in flight is done: where the nodes
        share no disk, the store's (a URL)."""
        self.wait()
        assert self.disks is not None
        if self._copy is not None and not self.disks.shared:
            done = self._copy.store.complete()
            return f"{self._copy.store.url}/step_{done[-1]}" if done else None
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

    def roll_back(self) -> TrainerState | None:
        """Collective, train.nonfinite=rollback: the newest valid checkpoint back into the
        engine (weights, optimizer, loss scale, RNG); returns its trainer state (None: no valid
        checkpoint to go back to). The data position is not restored: training goes on after
        the batches that failed."""
        engine = self.engine()
        with self.paused():
            self.wait()
            self._bring_back()
            ckpt = checkpoint.latest_valid(self.paths.checkpoints, self.world, self.say)
            if ckpt is None:  # none written, or all damaged: nothing to go back to
                return None
            parallel = self.parts["identity"].state_dict()["parallel"]
            state, _ = checkpoint.resume_state(ckpt, self.world, engine, self.layout, parallel)
        engine.load_extra_state(state.engine_state)
        return state

    def verify_round_trip(self) -> None:
        """Collective, checkpoint.verify_on_start: save into a scratch directory, load it
        back natively, compare every tensor with the files (checkpoint.verify), remove it."""
        scratch = self.paths.checkpoints / ".verify_on_start"
        assert self.disks is not None
        apart = self._copy if not self.disks.shared else None  # no disk holds it whole: through the store
        engine = self.engine()
        checkpoint.save_checkpoint(scratch, self.world, engine.save, **self._contents(scratch, state_of(self.parts), copy=apart))
        if apart is not None:
            if self.disks.leader:
                apart.store.fetch(scratch.name, scratch)
            barrier(self.world)
        engine = self.engine()
        checkpoint.load_checkpoint(scratch, self.world, lambda p: engine.load(p / "state"))
        checkpoint.verify(scratch, self.world, engine, self.layout)
        barrier(self.world)
        if self.disks.leader:
            shutil.rmtree(scratch)
        if apart is not None and self.world.is_main:
            apart.store.remove(scratch.name)

    def _bring_back(self) -> None:
        """Collective, where the nodes share no disk: the store's newest complete checkpoint
        onto every disk (checkpoint/remote.py), as at the start, before a rollback reads it."""
        assert self.disks is not None
        if self._copy is None or self.disks.shared:
            return
        if self.disks.leader:
            bring_back(self._copy.store.url, self.paths.checkpoints, self.say if self.world.is_main else lambda line: None)
        barrier(self.world)

    def _contents(
        self, target: Path, state: dict[str, Any], export: Callable[[], Any] = lambda: None, copy: StoreCopy | None = None
    ) -> dict[str, Any]:
        """checkpoint.save_checkpoint's arguments besides the engine's writer: the trainer
        state (the parts' and the engine's stamp), the small files, what runs once the
        checkpoint is sealed (`export`, then pruning), the store's copy and the disks."""
        engine = self.engine()
        trainer_state = TrainerState(format=engine.format, engine=engine.name, engine_state=engine.extra_state(), **state)
        files = {"config.yaml": self.cfg.to_yaml(), **engine.checkpoint_files()}
        step, keep, root, main, disks = (
            state["step"],
            self.cfg.checkpoint.keep,
            self.paths.checkpoints,
            self.world.is_main,
            self.disks,
        )
        assert disks is not None
        # Pruning after the marker: until then the older checkpoints are the newest whole ones.
        # Where the nodes share no disk, each disk's part of it goes once copied (checkpoint/disks.py).
        prune: Callable[[], Any] = lambda: None
        if not disks.shared and disks.leader and copy is not None and target.name == f"step_{step}":
            prune = lambda: clear_copied(root, step)  # noqa: E731
        elif disks.shared and main and target.parent == root:
            prune = lambda: checkpoint.prune(root, keep)  # noqa: E731
        return {"trainer_state": trainer_state, "files": files, "then": lambda: (export(), prune()), "copy": copy, "disks": disks}

    def _hf_then(self, target: Path, step: int, hf: bool) -> Callable[[], Any]:
        """After the marker and the copy, before pruning (which may remove an older one, never
        this one): the export reads the complete checkpoint, the next save waits for it."""
        return (lambda: self._export_hf(target, step)) if self.world.is_main and hf else (lambda: None)

    def _export_hf(self, ckpt: Path, step: int) -> None:
        """Rank 0: `ckpt` as a Hugging Face directory, <run.dir>/hf/step_<N> (checkpoint/hf_export.py)."""
        from scaletrain.checkpoint.hf_export import export_checkpoint

        out = self.paths.root / "hf" / f"step_{step}"
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():  # a resumed run passing the same step again: that export is of these weights
            return
        start = time.perf_counter()
        store = CheckpointStore(self.cfg.checkpoint.dir) if self.cfg.checkpoint.dir else None
        assert self.disks is not None
        if not self.disks.shared and store is not None:  # no disk holds it whole: the store's copy, read back
            whole = store.download(step, self.paths.checkpoints / ".export")
            done = export_checkpoint(whole, out, tokenizer=self.tokenizer)
            shutil.rmtree(whole.parent)
        else:
            done = export_checkpoint(ckpt, out, tokenizer=self.tokenizer)
        if store is not None:  # beside the checkpoints in object storage: <url>/hf/step_<N>, its index last
            store.upload(out, f"hf/{out.name}", last="model.safetensors.index.json")
        # Logged by the loop's thread with the save's own row (this may run in the save's).
        self._exported.append({"step": step, "event": "hf_export", "path": str(out), "bytes": done["bytes"],
                               "total_s": time.perf_counter() - start})  # fmt: skip

    def _event(self, step: int, background: bool, blocking: float, waited: float, total: float) -> None:
        row = {"step": step, "event": "checkpoint", "async": background, "blocking_s": blocking}
        exported, self._exported[:] = list(self._exported), []
        self.metrics.write([{**row, "waited_for_previous_s": waited, "total_s": total}, *exported])
