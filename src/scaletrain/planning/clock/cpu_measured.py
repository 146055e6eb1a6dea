"""This CPU's measured costs (the clock's rates where the device a plan trains on is the
planning machine's own CPU: clock/rates.py): every traced call replayed at its exact shapes
(clock/replay.py), AdamW's step, the host's cost per dispatched operation, how a pass's
operations run one after another against each alone, and the copy bandwidth; each measured
once per machine, thread count, kernel family and torch, kept in the disk cache with whether
the machine was busy when it was measured (clock/contention.py), and in this process's memory
only where it was quiet."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from scaletrain import disk_cache
from scaletrain.planning.clock import contention
from scaletrain.planning.clock.measure import copy_bandwidth, host_op_seconds, in_sequence, optimizer_seconds
from scaletrain.planning.clock.trace import Call

CALLS_FILE = "clock-calls"
# What this process priced with measurements taken while other processes used the CPU: by
# the measurement's key, the cores they used (clock/contention.py; StepTime's notes say so).
BUSY_MEASURED: dict[str, float] = {}
BUSY_USED = [0]  # how many times this process used a busy measurement (compute.py keeps no price made with one)


def _kept(threads: int, measure: Callable[[], float], *fields: Any) -> float:
    """measure() at `threads` threads, kept in CALLS_FILE with whether the machine was busy
    when it ran: a busy entry is measured again by a process that finds the machine quiet."""
    return _measured(threads, measure, *fields)[0]


def _measured(threads: int, measure: Callable[[], float], *fields: Any) -> tuple[float, bool]:
    """_kept's value, and whether it was measured on a busy machine."""
    entry = contention.kept(CALLS_FILE, cpu_key(*fields), threads, measure, "s")
    if entry["busy"] is not None:
        BUSY_MEASURED[json.dumps(fields)] = entry["busy"]
        BUSY_USED[0] += 1
    else:  # measured again on a quiet machine, or a quiet entry found
        BUSY_MEASURED.pop(json.dumps(fields), None)
    return float(entry["s"]), entry["busy"] is not None


class _QuietCache:
    """A process's own memory of `fn`'s measurements (value, busy; `fn`'s last argument its
    thread count), as the disk cache keeps them: one taken while other work held the CPUs
    serves only while the machine is still busy, and is measured again once it is quiet.
    (CI's clock test, 2026-12-01: its world-1 configurations predicted 2-5x their measured
    steps in both rounds, the second round's prices this process's memory of the first's
    replays, kept whatever the machine did next.)"""

    def __init__(self, fn: Callable[..., tuple[float, bool]]) -> None:
        self.fn = fn
        self.kept: dict[tuple[Any, ...], tuple[float, bool]] = {}

    def __call__(self, *args: Any) -> float:
        hit = self.kept.get(args)
        if hit is not None and (not hit[1] or contention.busy(args[-1]) is not None):
            if hit[1]:
                BUSY_USED[0] += 1
            return hit[0]
        value, busy = self.fn(*args)
        if len(self.kept) >= 65536:
            self.kept.clear()
        self.kept[args] = (value, busy)
        return value

    def cache_clear(self) -> None:
        self.kept.clear()


def busy_note() -> list[str]:
    """A line when this process priced with measurements taken on a busy CPU."""
    if not BUSY_MEASURED:
        return []
    return [contention.note(max(BUSY_MEASURED.values()), len(BUSY_MEASURED))]


def cpu_key(*fields: Any) -> list[Any] | None:
    cpu = disk_cache.cpu_identity()
    if cpu is None:
        return None
    return [*cpu, torch.__version__, os.environ.get("ATEN_CPU_CAPABILITY", ""), *fields]


def replayed_seconds(c: Call, threads: int) -> float:
    """One call's seconds replayed on this CPU at `threads` threads (kept: _replayed)."""
    return _replayed(c.op, c.args, threads)


@_QuietCache
def _replayed(op: str, args: str, threads: int) -> tuple[float, bool]:
    from scaletrain.planning.clock.replay import seconds

    def measure() -> float:
        with Threads(threads):
            try:
                return seconds(op, args)
            except Exception:  # noqa: BLE001 - an operation that cannot be rebuilt is priced by its bytes below
                return -1.0

    value, busy = _measured(threads, measure, "call", threads, op, args)
    if value < 0:
        from scaletrain.planning.clock.replay import call_bytes

        return call_bytes(args) * 2 / cpu_bandwidth(threads), busy
    return value, busy


@_QuietCache
def _measured_optimizer(params: int, tensors: int, threads: int) -> tuple[float, bool]:
    def measure() -> float:
        with Threads(threads):
            return optimizer_seconds(params, tensors)

    return _measured(threads, measure, "optimizer-step", threads, params, tensors)


@_QuietCache
def cpu_host_op(threads: int) -> tuple[float, bool]:
    def measure() -> float:
        with Threads(threads):
            return host_op_seconds(lambda c: _replayed(c.op, c.args, threads), prepare=prepared_call)

    return _measured(threads, measure, "host-op", threads)


@_QuietCache
def cpu_in_sequence(threads: int) -> tuple[float, bool]:
    def measure() -> float:
        with Threads(threads):
            return in_sequence(prepared_call, lambda c: _replayed(c.op, c.args, threads), cpu_host_op(threads))

    return _measured(threads, measure, "in-sequence", threads)


def prepared_call(c: Call) -> Callable[[], Any] | None:
    """The call ready to run with its arguments rebuilt, None where they cannot be (replay.py)."""
    from scaletrain.planning.clock.replay import prepared

    try:
        call = prepared(c.op, c.args)
        call()  # one that cannot run fails here, as replay.seconds would
        return call
    except Exception:  # noqa: BLE001 - priced by its kept replay instead (_replayed: its bytes)
        return None


@_QuietCache
def cpu_bandwidth(threads: int) -> tuple[float, bool]:
    def measure() -> float:
        with Threads(threads):
            return copy_bandwidth()

    return _measured(threads, measure, "bandwidth", threads)


class Threads:
    """torch's intra-op threads set to `n` inside (the ranks' count, not the planner's)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.old = torch.get_num_threads()
        if self.n != self.old:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc: Any) -> None:
        if torch.get_num_threads() != self.old:
            torch.set_num_threads(self.old)
