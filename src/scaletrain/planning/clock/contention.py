"""Whether other processes are using this machine's CPUs while the clock measures on it.

A replay timed beside other work is not slow by a few percent but by orders of magnitude:
with every core taken, an OpenMP pool of two threads waits for the scheduler at each
parallel region (an RMSNorm's mean over 256 x 128 floats replayed at 12 ms instead of
~10 us, AdamW over 1.3M parameters at 78 ms instead of 3 ms: a tiny run's step predicted
at 0.30 s against 0.05 s measured, the planner's cache having kept times measured while a
test suite ran). So each measurement the clock keeps says whether the machine was busy
when it was taken (clock/rates.py): a process that finds the machine quiet measures such an
entry again rather than trusting it, and a plan priced with one says so.

How busy: the CPU time spent on the CPUs this process may run on over a short sleep of it,
less this process's own, in cores. Read from Linux's counters: /proc/stat's line for each of
those CPUs, which counts everything that kept them from this process (other containers'
processes, the kernel's own threads, and in a virtual machine the time the hypervisor gave
its core to another guest: "steal"), none of which a container's cgroup counter sees. Where a CPU quota makes this container a slice of a shared
host (cgroup v2's cpu.max), its cgroup's counter instead: the host's other tenants then run
on cores this container does not use. Where neither is readable nothing is known and every
measurement counts as quiet, as before.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain import disk_cache

PROBE_S = 0.1  # the sleep the others' CPU time is read over: 10 ticks of the kernel's 100 Hz
REPROBE_S = 2.0  # a probe holds this long: measurements come in bursts of many short calls
# Busy: others take more than a quarter of the CPUs this process may use, or leave it fewer
# cores than its threads (+ a quarter core of slack: an idle machine reads 0.00-0.01 here).
SHARE, SLACK = 0.25, 0.25

_LAST: tuple[float, float | None] = (-1e9, None)


def _machine_seconds() -> float | None:
    """The CPU seconds spent on this process's CPUs, by anything (module docstring)."""
    cgroup = _read("/sys/fs/cgroup/cpu.stat")
    if cgroup is not None and _has_quota(_read("/sys/fs/cgroup/cpu.max")):
        return _cgroup_seconds(cgroup)
    stat = _read("/proc/stat")
    spent = _stat_seconds(stat, _affinity()) if stat is not None else None
    if spent is None and cgroup is not None:
        return _cgroup_seconds(cgroup)
    return spent


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None


def _has_quota(cpu_max: str | None) -> bool:
    """cgroup v2's cpu.max ("max 100000", or "<quota> <period>"): whether a quota is set."""
    return cpu_max is not None and cpu_max.split()[:1] not in ([], ["max"])


def _cgroup_seconds(cpu_stat: str) -> float | None:
    for line in cpu_stat.splitlines():
        if line.startswith("usage_usec "):
            try:
                return int(line.split()[1]) / 1e6
            except ValueError:
                return None
    return None


def _stat_seconds(stat: str, cpus: set[int] | None) -> float | None:
    """The non-idle seconds of /proc/stat's lines for `cpus` (user, nice, system, irq,
    softirq and steal; idle and iowait not), or of its total line where `cpus` is unknown or
    names a CPU it has no line for."""
    total: float | None = None
    per_cpu: dict[int, float] = {}
    for line in stat.splitlines():
        if not line.startswith("cpu"):
            continue
        name, *rest = line.split()
        try:
            fields = [int(v) for v in rest]
        except ValueError:
            return None
        if len(fields) < 4:
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
        busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
        if name == "cpu":
            total = busy
        elif name[3:].isdigit():
            per_cpu[int(name[3:])] = busy
    if cpus and cpus <= per_cpu.keys():
        return sum(per_cpu[c] for c in cpus)
    return total


def _own_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def others_cores() -> float | None:
    """Cores other processes kept busy over the last probe (taken again after REPROBE_S), or
    None where the machine's counters are not readable."""
    global _LAST
    now = time.monotonic()
    if now - _LAST[0] < REPROBE_S:
        return _LAST[1]
    t0, m0, o0 = time.perf_counter(), _machine_seconds(), _own_seconds()
    value = None
    if m0 is not None:
        time.sleep(PROBE_S)
        t1, m1, o1 = time.perf_counter(), _machine_seconds(), _own_seconds()
        if m1 is not None:
            value = max(0.0, ((m1 - m0) - (o1 - o0)) / (t1 - t0))
    _LAST = (time.monotonic(), value)
    return value


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def busy(threads: int) -> float | None:
    """The cores others use when that makes measuring at `threads` threads untrustworthy
    (module docstring), else None."""
    others = others_cores()
    n = cores()
    if others is None or others <= min(SHARE * n, max(0.0, n - threads) + SLACK):
        return None
    return round(others, 2)


def note(others: float, measured: int) -> str:
    return (
        f"this CPU was busy while the clock measured {measured} of the operations it priced (other processes "
        f"used {others:.1f} of its {cores()} cores): those times are slow; a plan on a quiet machine measures them again"
    )


def kept(file: str, key: list[Any] | None, threads: int, measure: Callable[[], float], name: str) -> dict[str, Any]:
    """measure() at `threads` threads as `{name: value, "busy": cores or None}`, kept in the
    disk cache's `file` under `key` (None: not kept): an entry measured on a busy machine, or
    an older file's bare number (whether it was busy is unknown), is measured again by a
    process that finds the machine quiet."""

    def timed() -> dict[str, Any]:
        return {"busy": busy(threads), name: measure()}

    def usable(entry: Any) -> bool:
        if not isinstance(entry, dict) or not isinstance(entry.get(name), float):
            return False
        return entry.get("busy") is None or busy(threads) is not None

    return timed() if key is None else disk_cache.cached(file, key, timed, usable)


QUIET_PROBES = 3  # in a row: a moment's lull between another process's bursts is not quiet


def wait_quiet(threads: int, limit_s: float) -> tuple[float, float | None]:
    """Wait, at most `limit_s`, until other processes leave this machine's CPUs for measuring
    at `threads` threads (QUIET_PROBES probes in a row find it quiet): a timing started just
    as other work ends (a test suite's last processes, the kernel writing their files back)
    measures that work's tail. Returns the seconds waited and the cores others still used
    at the end (None: quiet, or the machine's counters are not readable)."""
    t0 = time.monotonic()
    quiet = 0
    while True:
        others = busy(threads)
        quiet = quiet + 1 if others is None else 0
        if quiet >= QUIET_PROBES or time.monotonic() - t0 >= limit_s:
            return time.monotonic() - t0, others
        time.sleep(REPROBE_S)  # a probe within REPROBE_S of the last reads the last
