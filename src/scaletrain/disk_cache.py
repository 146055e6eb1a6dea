"""Small results kept across processes in one JSON file each (`$SCALETRAIN_CACHE` or
`~/.cache/scaletrain`): what many short processes of one machine would otherwise each
compute again (the planner's activation traces: planning/trace_cache.py; py-cpuinfo's answer:
engines/deepspeed.py; the CPU's measured matmul rate: planning/hardware.py). Keys are hashed from everything the result depends on, so a key
that changes misses and computes again. Writes replace the file atomically, with what it
holds just before (entries other processes kept meanwhile stay); two processes writing in
the same moment may lose an entry (computed again later), never corrupt the file. Any I/O
problem (a read-only home) just means computing, as without the cache;
`SCALETRAIN_CACHE=off` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_ENTRIES = 4096  # a bound on a file's size; past it, the oldest half is dropped


def cached(file: str, key: Any, compute: Callable[[], Any], usable: Callable[[Any], bool] | None = None) -> Any:
    """compute(), or its earlier result under the same JSON-able `key` in `file` where
    `usable` (if given) accepts it (else computed again and replaced)."""
    path = cache_path(file)
    if path is None:
        return compute()
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()
    entries = _read(path)
    if digest in entries and (usable is None or usable(entries[digest])):
        return entries[digest]
    value = compute()
    # Read again: what other processes kept while this one computed (seconds, for a replay
    # or a trace: ranks and tests plan side by side) stays, rather than the last writer's
    # entries alone. Two writes within the same moments can still lose one.
    entries = _read(path)
    entries[digest] = value
    if len(entries) > MAX_ENTRIES:
        entries = dict(list(entries.items())[len(entries) // 2 :])
    _write(path, entries)
    return value


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


# Each file as this process last read or wrote it, by its size and modification time: a
# file of the planner's traces grows to megabytes, which every lookup parsed again.
_SEEN: dict[Path, tuple[tuple[int, int], dict[str, Any]]] = {}


def _read(path: Path) -> dict[str, Any]:
    try:
        stat = path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
        seen = _SEEN.get(path)
        if seen is not None and seen[0] == stamp:
            return dict(seen[1])
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(entries, dict):
        return {}
    _SEEN[path] = (stamp, entries)
    return dict(entries)


def _write(path: Path, entries: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)
        stat = path.stat()
        _SEEN[path] = ((stat.st_mtime_ns, stat.st_size), dict(entries))
    except OSError:
        tmp.unlink(missing_ok=True)
