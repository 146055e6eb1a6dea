"""Exposed communication: how long a rank waits for collectives, sampled with torch.profiler.

No engine-neutral counter tells waiting from working: DDP's all-reduce wait sits inside
backward, FSDP2's all-gather waits inside forward and backward, ZeRO's reductions inside
backward or the optimizer step, and on CUDA the host does not even see them. So every
`telemetry.comm_sample_every` steps (the same steps on every rank) one whole step runs
under the profiler, and the time the training thread spent inside communication and its
waits in that step (telemetry/profile.py says which events count and why) is this rank's
sample: {"step", "total_s", "comm_s"}. The interval's per-rank comm_s applies the sample's
share to the interval's step time; stragglers are judged on the sample's busy time
(total - comm), which the others' waiting does not blur. The cost, one profiled step in
`comm_sample_every`, is measured in docs/telemetry.md.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from scaletrain.telemetry.profile import STEP_PREFIX, analyze_trace, prepare_profiler

# Kineto prints two "USDT: ... profiler_start/stop" lines per profiled window on stderr at its
# default level; 6 is above its highest (USDT = 5). Read when the profiler starts.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


class CommSampler:
    def __init__(self, every: int, device: torch.device):
        self.every = every
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.cuda = device.type == "cuda"
        self._sample: dict[str, float] | None = None
        if every:
            prepare_profiler()  # its one-time start cost would otherwise land in the first sample

    @contextlib.contextmanager
    def around(self, step: int, allowed: bool = True) -> Iterator[None]:
        """Wrap the whole of optimizer step `step` (1-based); `allowed` is False while another
        profiler runs (the telemetry.profile_steps window: one profiler at a time)."""
        if not (allowed and self.every and step % self.every == 0):
            yield
            return

        if self.cuda:
            torch.cuda.synchronize()  # the sampled step starts with an idle device
        with profile(activities=self.activities, record_shapes=False, with_stack=False) as prof:
            t0 = time.perf_counter()
            with record_function(f"{STEP_PREFIX}{step}"):  # the range analyze_trace measures within
                yield
                if self.cuda:
                    torch.cuda.synchronize()
            total = time.perf_counter() - t0
        # Exported and read back: cheaper than the profiler's own event tree (prof.events()),
        # and the very reader that diagnose applies to telemetry.profile_steps traces.
        with tempfile.TemporaryDirectory(prefix="scaletrain-comm-") as tmp:
            trace = Path(tmp) / "step.json"
            prof.export_chrome_trace(str(trace))
            comm = analyze_trace(trace)["comm_s"]
        self._sample = {"step": step, "total_s": total, "comm_s": min(total, comm)}

    def take(self) -> dict[str, float] | None:
        sample, self._sample = self._sample, None
        return sample
