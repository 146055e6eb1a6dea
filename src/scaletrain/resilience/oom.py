"""Out of memory, survived: the run continues at a smaller micro-batch, same global batch.

`torch.OutOfMemoryError` in a step (forward, backward or the optimizer step) on any rank:
the rank writes what happened into <run.dir>/oom/step<S>-rank<R>-mb<M>.json, with the next
smaller micro-batch that divides each rank's share of the global batch (grad_accum grows
to match, config/batch.py), and the run starts again from its newest whole checkpoint at that
micro-batch. Every later start of the run reads the directory and keeps the smallest
micro-batch named there: the choice is remembered across restarts and resumes (delete
the directory to go back to the configured one). The numbers stay those of a run started
at the smaller micro-batch: the same global batch, the same data position (the
checkpoint's), summation order aside.

Where the start happens depends on who else could be waiting:
  one process   in-process: the engine and everything built for the run are released,
                the memory freed, and the run starts again inside this process
                (trainer._train): no other rank can be inside a collective.
  several       the rank exits with EXIT_OOM at once: its peers may already be inside a
                collective it will never join (DDP's bucketed all-reduce in backward,
                FSDP's prefetching all-gathers, DeepSpeed's reduce-scatter), which no
                in-process retry can take back. A peer that sees the collective fail
                finds the record and exits with EXIT_OOM too; torchrun's agent stops the
                rest, and `scaletrain launch` (or the agent, under --max-restarts)
                starts every rank again.
Each record is logged once, as an `"event": "oom"` row of metrics.jsonl, by the next
start's rank 0 (diagnose reads it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scaletrain.config import Config
from scaletrain.config.batch import described, micro_batches, per_rank, with_micro_batch
from scaletrain.errors import EXIT_OOM, OutOfMemoryRestart, UserError
from scaletrain.files import write_atomic

DIRNAME = "oom"


@dataclass
class OomEvent:
    step: int
    rank: int
    phase: str  # forward | backward | optimizer
    micro_batch: int
    grad_accum: int
    next_micro_batch: int
    next_grad_accum: int
    global_batch: int
    path: str  # in-process | restart
    error: str  # the first line of torch's message
    time: float
    logged: bool = False

    def row(self) -> dict[str, Any]:
        """Its row in metrics.jsonl."""
        return {"event": "oom", **{k: v for k, v in asdict(self).items() if k != "logged"}}

    def said(self) -> str:
        return (
            f"out of memory on rank {self.rank} in {self.phase} at step {self.step} (train.micro_batch={self.micro_batch}): "
            f"continuing at {described(self.next_micro_batch, self.next_grad_accum, self.global_batch)} from the newest "
            f"checkpoint, {'inside this process' if self.path == 'in-process' else 'every rank restarted'}"
        )


def survive(
    cfg: Config, root: Path, world_size: int, rank: int, dp: int, step: int, phase: str, error: BaseException,
    let_save_finish: Callable[[], None],
) -> None:  # fmt: skip
    """After `error` (torch.OutOfMemoryError) in `phase` of step `step`: record it and end
    the run's attempt (after the save in flight, if any, completed); one UserError where the
    micro-batch is already the smallest."""
    t = cfg.train
    smaller = [b for b in micro_batches(per_rank(t, dp), cfg.parallel.pp, cfg.parallel.pp_schedule) if b < t.micro_batch]
    if not smaller:
        raise UserError(
            f"out of memory on rank {rank} in {phase} at step {step}, at the smallest micro-batch "
            f"({described(t.micro_batch, t.grad_accum, per_rank(t, dp) * dp)}); accepted: "
            "parallel.activation_checkpointing=true, a sharding or offloading strategy (`scaletrain plan` ranks them), "
            "a shorter data.seq_len, or more devices"
        )
    b = smaller[0]
    event = OomEvent(
        step, rank, phase, t.micro_batch, t.grad_accum, b, per_rank(t, dp) // b, per_rank(t, dp) * dp,
        "in-process" if world_size == 1 else "restart", str(error).strip().splitlines()[0][:300] if str(error).strip() else "",
        time.time(),
    )  # fmt: skip
    _write(root, event)
    print(f"scaletrain: {event.said()}", file=sys.stderr, flush=True)
    if world_size == 1:
        raise OutOfMemoryRestart(event.said())  # the trainer's exit waits for a save in flight
    let_save_finish()
    sys.stdout.flush()
    os._exit(EXIT_OOM)  # no teardown: a peer may be inside a collective this rank never joins


def peer_ran_out(root: Path, step: int) -> bool:
    """Whether another rank recorded an out-of-memory error at `step` (what made this rank's
    collective fail): this rank then ends its attempt the same way."""
    return any(e.step == step for e in events(root))


def exit_with_peer(let_save_finish: Callable[[], None]) -> None:
    let_save_finish()
    sys.stderr.flush()
    os._exit(EXIT_OOM)


def events(root: Path) -> list[OomEvent]:
    out = []
    for path in sorted((Path(root) / DIRNAME).glob("step*-rank*.json")):
        try:
            out.append(OomEvent(**json.loads(path.read_text())))
        except (ValueError, TypeError):
            raise UserError(
                f"{path} is not an out-of-memory record scaletrain wrote; accepted: delete it (or the {DIRNAME} directory)"
            ) from None
    return out


def remembered(cfg: Config, root: Path, dp: int) -> tuple[Config, list[str]]:
    """`cfg` at the smallest micro-batch an out-of-memory error left in `root` (where that
    is smaller than the configured or planned one), with the line saying so."""
    found = events(root)
    if not found:
        return cfg, []
    cap = min(e.next_micro_batch for e in found)
    t = cfg.train
    options = [b for b in micro_batches(per_rank(t, dp), cfg.parallel.pp, cfg.parallel.pp_schedule) if b <= cap]
    if t.micro_batch <= cap or not options:
        return cfg, []
    last = max(found, key=lambda e: e.time)
    why = (
        f"out of memory on rank {last.rank} in {last.phase} at step {last.step} with train.micro_batch={last.micro_batch} "
        f"({Path(root) / DIRNAME}; delete it to go back to the configured micro-batch)"
    )
    new = with_micro_batch(cfg, dp, options[0], why)
    line = (
        f"oom: train.micro_batch {t.micro_batch} -> {new.train.micro_batch}, train.grad_accum {t.grad_accum} -> "
        f"{new.train.grad_accum} (global batch {t.global_batch} unchanged): {why}"
    )
    return new, [line]


def log_new(root: Path, log: Any) -> None:
    """Rank 0: each record not yet in metrics.jsonl, as an event row through `log`."""
    for event in events(root):
        if not event.logged:
            log(event.row())
            event.logged = True
            _write(root, event)


def _write(root: Path, event: OomEvent) -> None:
    directory = Path(root) / DIRNAME
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(
        directory / f"step{event.step}-rank{event.rank}-mb{event.micro_batch}.json", json.dumps(asdict(event), indent=1) + "\n"
    )
