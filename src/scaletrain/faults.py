"""Fault injection for recovery tests and drills: SIGKILL this process at a named point.

`SCALETRAIN_KILL_AT=<point>:<step>` kills every rank that reaches the point at that step,
exactly as an OOM-killer or a preempted node would (no handler runs, nothing is flushed):

  step     right after optimizer step <step>
  save     inside the save of checkpoint <step>: model, optimizer, RNG and trainer.json
           are on disk, the COMPLETE marker is not
  prune    inside the pruning after checkpoint <step>: an old checkpoint has lost its
           marker and not yet its files
  metrics  inside the metrics flush at step <step>: half of the rows' text is written

The variable is read once; an unset variable costs one comparison per point.
"""

from __future__ import annotations

import os
import signal

from scaletrain.errors import UserError

ENV = "SCALETRAIN_KILL_AT"
POINTS = ("step", "save", "prune", "metrics")


def parse(value: str) -> tuple[str, int] | None:
    """`point:step` -> (point, step); empty -> None; anything else is a UserError."""
    if not value:
        return None
    point, _, step = value.partition(":")
    if point not in POINTS or not step.isdigit() or int(step) < 1:
        raise UserError(f"{ENV}={value!r} is invalid; accepted: POINT:STEP with POINT one of {', '.join(POINTS)} and STEP >= 1")
    return point, int(step)


_ARMED = parse(os.environ.get(ENV, ""))


def armed(point: str, step: int) -> bool:
    return _ARMED is not None and (point, step) == _ARMED


def kill_at(point: str, step: int) -> None:
    """SIGKILL this process if the fault is armed for (point, step)."""
    if armed(point, step):
        kill()


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
