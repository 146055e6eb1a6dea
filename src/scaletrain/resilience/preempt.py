"""Preemption: SIGTERM or SIGUSR1 stops every rank at the same step boundary, saves, and
exits with EXIT_PREEMPTED.

Schedulers announce a preemption with a signal (Slurm: SIGTERM, or SIGUSR1 with
`--signal`; Kubernetes: SIGTERM; torchrun's agent forwards the SIGTERM it gets to every
worker), then wait a grace period before SIGKILL. A handler only sets a flag: Python runs
it between bytecodes, and a rank blocked in a collective sees it when that returns. At
each step boundary the ranks agree on the flag with one all-reduce of a single integer on
a CPU (gloo) group of its own, asynchronous (started at one boundary, read at the next:
no step waits for it), so a signal that reached only some ranks, or reached them during
different steps, still stops all of them after the same step.
"""

from __future__ import annotations

import contextlib
import signal
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.errors import Preempted
from scaletrain.launch.distributed import World, side_group

__all__ = ["Preempted", "PreemptionWatch"]

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatch:
    """Installs the handlers (main thread only) and answers `agreed()` once per step."""

    def __init__(self, world: World):
        self.world = world
        self.signum = 0
        self._previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        # Gloo even when training uses NCCL: the check stays on the CPU (no device sync).
        self._group = side_group("preemption") if world.distributed else None
        self._pending: tuple[Any, torch.Tensor] | None = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def received(self) -> bool:
        """Whether this rank was signalled (not yet agreed with the others)."""
        return self.signum != 0

    def agreed(self) -> int:
        """Collective: the signal any rank had received one step earlier (0: none), the same
        on every rank. The all-reduce started at one step boundary is waited for at the
        next, so it runs beside a whole step and never holds the loop up; the stop comes
        one step after the signal, well inside any scheduler's grace period."""
        if self._group is None:
            return self.signum
        agreed = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = int(flag.item())
        flag = torch.tensor([self.signum], dtype=torch.int64)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return agreed

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._pending is not None:
            # Every rank started this one at the same boundary; a rank that died meanwhile
            # makes it fail, which must not hide the error that ends the run.
            with contextlib.suppress(RuntimeError):
                self._pending[0].wait(timeout=timedelta(seconds=30))
            self._pending = None
