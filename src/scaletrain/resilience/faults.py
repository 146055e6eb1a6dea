"""Fault injection for recovery tests and drills.

`SCALETRAIN_KILL_AT=<point>:<step>[@<rank>|@group<g>]` SIGKILLs every rank (or only `rank`,
or every rank of replica group g: fault_tolerance) that reaches the point at that step,
exactly as an OOM-killer or a lost node would (no handler runs, nothing is flushed):

  step     right after optimizer step <step> (and its checkpoint, complete, if it has one)
  down     as `step`, and the process that replaces it waits DOWN_S seconds before it
           starts: a node that takes a while to come back (replica groups: its peers go on
           without it meanwhile, the lighthouse having stopped hearing it)
  save     inside the save of checkpoint <step>: model, optimizer, RNG and trainer.json
           are on disk, the COMPLETE marker is not
  upload   inside the copy of checkpoint <step> to checkpoint.dir (checkpoint/remote.py):
           every rank's files are in the store, the marker is not
  prune    inside the pruning after checkpoint <step>: an old checkpoint has lost its
           marker and not yet its files
  metrics  inside the metrics flush at step <step>: half of the rows' text is written
  term     not a kill: after step <step>, SIGTERM to the launcher (torchrun's agent, which
           forwards it to every worker) or, without one, to this process: a preemption.
           The rank waits until the signal is back in its own handler, so every rank
           agrees to stop after step <step> + 1 however slowly the launcher forwards it
  nan      not a kill: the loss of step <step> is NaN (so are its gradients), once per
           process, as a blown-up batch would make it (train.nonfinite)
  spike    not a kill: the loss of step <step> is multiplied by SPIKE_FACTOR (so are its
           gradients), once per process, as a poisoned batch would (train.spikes)
  perturb  not a kill: after step <step>, one weight of this rank's replica moves by 1e-3,
           as a flipped bit or a bad kernel would (guards.weight_hash_every)
  hang     not a kill: after step <step> the rank stops making progress (sleeps), as a
           deadlocked data loader or a wedged device would (guards.hang_timeout_s)
  oom      not a kill: the first forward of step <step> raises torch.OutOfMemoryError on
           the rank, once per process, as a longer batch or fragmentation would (resilience/oom.py)

`SCALETRAIN_SLOW=<kind>:<seconds>[@<rank>][,...]` slows every step instead, for telemetry:
  compute  the rank sleeps inside each forward (a slower GPU, a throttled host)
  comm     each DDP gradient bucket's all-reduce completes that much later on the rank (a
           slow link); the other ranks wait for it in their backward
  upload   each file a rank copies to checkpoint.dir waits that long first (a slow link
           to the store: a drill can stop the store while a copy is under way)

A comma-separated list is one fault per attempt under elastic restarts: entry i fires only
in attempt i (torchrun's TORCHELASTIC_RESTART_COUNT, plus the restarts `scaletrain launch`
made itself after an out-of-memory error: RELAUNCH_ENV), so `step:3@1,step:8@0` kills rank 1
at step 3, then, after the restart resumed from a checkpoint, rank 0 at step 8.
The variable is read once; an unset variable costs one comparison per point. The loop
meets every point through one `Drills` object: the loss it runs each step, and one hook
after the step (checkpoint/manager.py holds the points inside a save, a prune and a flush).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from scaletrain.errors import UserError
from scaletrain.launch.env import GROUP_ENV, RELAUNCH_ENV

ENV = "SCALETRAIN_KILL_AT"
POINTS = ("step", "down", "save", "upload", "prune", "metrics", "term", "nan", "spike", "perturb", "hang", "oom")
SPIKE_FACTOR = 1000.0
SLOW_ENV = "SCALETRAIN_SLOW"
SLOW_KINDS = ("compute", "comm", "upload")

Fault = tuple[str, int, int | str | None]  # point, step, rank or "group<g>" (None: every rank)


def parse(value: str) -> list[Fault]:
    """`point:step[@rank],...` -> [(point, step, rank)]; empty -> []; anything else is a UserError."""
    faults: list[Fault] = []
    for item in filter(None, value.split(",")):
        point, _, rest = item.partition(":")
        step, _, rank = rest.partition("@")
        group = rank.removeprefix("group")
        if point not in POINTS or not step.isdigit() or int(step) < 1 or (rank and not group.isdigit()):
            raise UserError(
                f"{ENV}={value!r} is invalid; accepted: POINT:STEP[@RANK|@groupG][,...] with POINT one of "
                f"{', '.join(POINTS)} and STEP >= 1"
            )
        faults.append((point, int(step), (rank if group != rank else int(rank)) if rank else None))
    return faults


DOWN_S = 3.0  # with the restart itself, longer than a lighthouse heartbeat timeout of 1-2 s


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + int(os.environ.get(RELAUNCH_ENV, "0"))


def _armed_now(attempt: int) -> tuple[str, int] | None:
    faults = parse(os.environ.get(ENV, ""))
    if not 0 <= attempt < len(faults):
        return None
    point, step, rank = faults[attempt]
    if isinstance(rank, str):  # group<g>: every rank of that replica group
        if rank != f"group{os.environ.get(GROUP_ENV, '')}":
            return None
    elif rank is not None and rank != int(os.environ.get("RANK", "0")):
        return None
    return point, step


_ARMED = _armed_now(_attempt())
_forked = False  # read again in a forked rank, once its environment (RANK) is set (launch/forked.py)


def _after_fork() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork)


def _current() -> tuple[str, int] | None:
    global _ARMED, _forked
    if _forked:
        _ARMED, _forked = _armed_now(_attempt()), False
    return _ARMED


def armed(point: str, step: int) -> bool:
    return _current() is not None and (point, step) == _ARMED


def fire_once(point: str, step: int) -> bool:
    """True the first time (point, step) is reached while armed: a fault of the data, which a
    rollback past it must not meet again."""
    global _ARMED
    if armed(point, step):
        _ARMED = None
        return True
    return False


def kill_at(point: str, step: int) -> None:
    """SIGKILL this process if armed for (point, step)."""
    if armed(point, step):
        kill()


def preempt_at(step: int, received: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """If `term` is armed for this step: SIGTERM the launcher (or this process without one)
    and wait until `received()` says the signal got here. Without the wait the stop step
    would depend on how fast the agent forwards it, and a test could not name it."""
    if armed("term", step):
        under_agent = "TORCHELASTIC_RUN_ID" in os.environ
        os.kill(os.getppid() if under_agent else os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while not received() and time.monotonic() < deadline:
            time.sleep(0.01)


def slowdown(kind: str) -> float:
    """Seconds this rank is to lose per step (or per gradient bucket) to `kind`; 0 when unset."""
    value = os.environ.get(SLOW_ENV, "")
    total = 0.0
    for item in filter(None, value.split(",")):
        name, _, rest = item.partition(":")
        seconds, _, rank = rest.partition("@")
        try:
            ok = name in SLOW_KINDS and float(seconds) >= 0 and (not rank or rank.isdigit())
        except ValueError:
            ok = False
        if not ok:
            raise UserError(
                f"{SLOW_ENV}={value!r} is invalid; accepted: KIND:SECONDS[@RANK][,...] with KIND one of {', '.join(SLOW_KINDS)}"
            )
        if name == kind and (not rank or int(rank) == int(os.environ.get("RANK", "0"))):
            total += float(seconds)
    return total


def slowed(loss: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    """`loss` that first sleeps: inside forward, so the rank's compute is what is slow."""

    def slow_loss(*args: Any) -> Any:
        time.sleep(seconds)
        return loss(*args)

    return slow_loss


def perturb(model: Any) -> None:
    """Move one weight of this rank's replica (fault point perturb): of the first norm, which
    every replica holds whole, also the ranks of a tensor-parallel group."""
    import torch

    param = next(p for n, p in model.named_parameters() if n.endswith("norm.weight"))
    with torch.no_grad():
        (param.to_local() if hasattr(param, "to_local") else param).view(-1)[0] += 1e-3


def hang_forever() -> None:
    while True:  # only the watchdog (or a signal) ends this
        time.sleep(1)


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Drills:
    """The fault points of the training loop. `loss(step, fn)`: the loss step `step` runs
    (NaN at `nan`, slowed by SCALETRAIN_SLOW=compute). `after_step(step)`: once the step
    and its checkpoint (if due) are done, before the ranks agree on a preemption: `term`,
    `perturb`, `hang` and `step` (which waits for the checkpoint in flight first, so the
    kill comes "after step N and its checkpoint")."""

    def __init__(self, model: Callable[[], Any], wait_for_saves: Callable[[], None], signal_received: Callable[[], bool]):
        self.model = model
        self.wait_for_saves = wait_for_saves
        self.signal_received = signal_received
        self.slow = slowdown("compute")
        before = _armed_now(_attempt() - 1)
        if before is not None and before[0] == "down":  # the previous attempt died at `down`: come back late
            time.sleep(DOWN_S)

    def loss(self, step: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        fn = nan_loss(fn) if fire_once("nan", step) else fn
        fn = spiked_loss(fn) if fire_once("spike", step) else fn
        fn = out_of_memory(fn) if fire_once("oom", step) else fn
        return slowed(fn, self.slow) if self.slow else fn

    def after_step(self, step: int) -> None:
        if _current() is None:
            return
        preempt_at(step, self.signal_received)
        if fire_once("perturb", step):
            perturb(self.model())
        if armed("hang", step):
            hang_forever()
        if armed("step", step) or armed("down", step):
            self.wait_for_saves()
            kill()


def nan_loss(loss: Callable[..., Any]) -> Callable[..., Any]:
    """The loss function, made NaN inside the graph (so are the gradients): faults point `nan`."""
    return lambda outputs, targets: loss(outputs, targets) * math.nan


def spiked_loss(loss: Callable[..., Any]) -> Callable[..., Any]:
    """The loss function x SPIKE_FACTOR (its gradients with it): faults point `spike`."""
    return lambda outputs, targets: loss(outputs, targets) * SPIKE_FACTOR


def out_of_memory(loss: Callable[..., Any]) -> Callable[..., Any]:
    """The loss function, raising as a forward out of device memory would: faults point `oom`."""

    def raising(*args: Any) -> Any:
        import torch

        raise torch.OutOfMemoryError(
            f"{ENV}: out of memory in forward (planted). Tried to allocate 2.00 GiB; this is a drill, not the device"
        )

    return raising
