"""Where each rank's step time goes: data wait, forward, backward, optimizer.

The loop and the engine's accumulation window mark phase boundaries; each mark closes the
phase that ran since the previous one. On CPU a mark is a perf_counter reading (the work
is synchronous, so the reading is exact). On CUDA a host reading would time kernel
launches, not kernels, so a mark records a CUDA event on the current stream and the
durations are read when the interval is flushed, after the metrics sync has waited for
the stream anyway: no extra host sync per step.

Exposed communication is not a phase of its own here: a gradient all-reduce (DDP), an
all-gather or reduce-scatter (FSDP2, ZeRO-3) waits inside forward or backward and is
counted there. `telemetry.comm` measures how much of that is waiting (see docs/telemetry.md).
"""

from __future__ import annotations

import time

import torch

PHASES = ("data", "forward", "backward", "optimizer")


class PhaseClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._sums = dict.fromkeys(PHASES, 0.0)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._last: float | torch.cuda.Event | None = None

    def _now(self) -> float | torch.cuda.Event:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        """The beginning of a step (the data phase starts here)."""
        self._last = self._now()

    def mark(self, phase: str) -> None:
        """`phase` ran from the previous mark until now."""
        now = self._now()
        if isinstance(now, float):
            assert isinstance(self._last, float)
            self._sums[phase] += now - self._last
        else:
            assert isinstance(self._last, torch.cuda.Event)
            self._pending.append((phase, self._last, now))
        self._last = now

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last take (all steps summed); resets."""
        for phase, begin, end in self._pending:
            end.synchronize()  # already complete after the metrics sync; this only makes sure
            self._sums[phase] += begin.elapsed_time(end) / 1e3
        sums, self._sums, self._pending = self._sums, dict.fromkeys(PHASES, 0.0), []
        return sums
