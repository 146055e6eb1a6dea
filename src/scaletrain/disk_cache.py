"""Small results kept across processes, one JSON file per entry (`$SCALETRAIN_CACHE` or
`~/.cache/scaletrain`, a folder per kind of result): what many short processes of one machine
would otherwise each compute again (the planner's traces: planning/trace_cache.py; the clock's
replayed operations: planning/clock/rates.py; py-cpuinfo's answer: engines/deepspeed.py; the
CPU's measured matmul rate: planning/hardware.py). Keys are hashed from everything the result
depends on, so a key that changes misses and computes again.

One file per entry, not one file per kind: the clock's traces grew to thousands of entries
(55 MB on a machine that planned for weeks), which every planning process parsed whole (2.4 s)
and every miss wrote back whole, so a suite's plans slowed as it ran. Now a lookup reads one
small file and a miss writes one: no process loses another's entry, and a reader never meets a
half-written one (each is written beside and renamed into place). Past MAX_ENTRIES in a folder
the oldest half is removed. Any I/O problem (a read-only home) just means computing, as
without the cache; `SCALETRAIN_CACHE=off` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_ENTRIES = 4096  # a bound on a folder's size; past it, the oldest half is removed


def cached(kind: str, key: Any, compute: Callable[[], Any], usable: Callable[[Any], bool] | None = None) -> Any:
    """compute(), or its earlier result under the same JSON-able `key` among `kind`'s entries
    (a folder of the cache) where `usable` (if given) accepts it (else computed again and replaced)."""
    folder = cache_path(kind)
    if folder is None:
        return compute()
    entry = folder / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()}.json"
    try:
        found = json.loads(entry.read_text())
        if usable is None or usable(found):
            return found
    except (OSError, ValueError):
        pass  # not kept yet, or damaged: computed and written again
    value = compute()
    _write(entry, value)
    return value


def forget(kind: str) -> None:
    """Remove every entry kept under `kind` (a bench that measures afresh)."""
    folder = cache_path(kind)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def cpu_identity() -> list[str] | None:
    """What identifies this machine's CPU: the host name and the vendor, model and flags
    lines of /proc/cpuinfo (not its clock speeds, which change); None where it is not
    readable (then nothing measured of the CPU is kept)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    wanted = ("vendor_id", "model name", "flags", "cpu family", "model\t", "processor")
    return [platform.node(), *sorted({line for line in lines if line.startswith(wanted)})]


def cache_path(file: str) -> Path | None:
    where = os.environ.get("SCALETRAIN_CACHE", "")
    if where.lower() == "off":
        return None
    return Path(where or Path.home() / ".cache" / "scaletrain") / file


def _write(entry: Path, value: Any) -> None:
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}-{secrets.token_hex(4)}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(value))
        os.replace(tmp, entry)
        _bound(entry.parent)
        # The one-file cache this replaced, where an older scaletrain left it (tens of MB).
        entry.parent.with_suffix(".json").unlink(missing_ok=True)
    except OSError:
        tmp.unlink(missing_ok=True)


def _bound(folder: Path) -> None:
    """Past MAX_ENTRIES entries, the oldest-written half removed (a miss only: a listing of a
    few thousand names is milliseconds beside the computation it follows)."""
    with os.scandir(folder) as found:
        entries = [e for e in found if e.name.endswith(".json") and not e.name.startswith(".")]
    if len(entries) <= MAX_ENTRIES:
        return
    entries.sort(key=lambda e: e.stat().st_mtime_ns)
    for e in entries[: len(entries) // 2]:
        Path(e.path).unlink(missing_ok=True)
