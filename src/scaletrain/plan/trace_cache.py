"""The planner's activation traces kept across processes.

Tracing what a block saves for backward runs the block under FakeTensorMode, whose first
use imports torch._dynamo and torch._inductor: ~0.45 s of a core in every process that
plans (rank 0 of each run, `scaletrain plan`), for a handful of integers that depend only
on the model, the trace's shape, the precision regime, torch and scaletrain's own model
and planner code. So each result is kept in one small JSON file
(`$SCALETRAIN_CACHE` or `~/.cache/scaletrain`, `activation-traces.json`), keyed by all of
those (the code by a hash of its source files): a later process with the same key reads
it instead of tracing. A key that changes (another torch, edited model code) misses and
traces again. Writes replace the file atomically; two processes writing at once may lose
an entry (it is traced again later), never corrupt the file. Any I/O problem (a read-only
home) just means tracing, as without the cache; `SCALETRAIN_CACHE=off` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

FILE = "activation-traces.json"
MAX_ENTRIES = 4096  # a bound on the file's size; past it, the oldest half is dropped


def cached(kind: str, fields: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
    """compute(), or its earlier result for the same (kind, fields) and code."""
    path = _path()
    if path is None:
        return compute()
    key = hashlib.sha256(json.dumps([kind, [repr(f) for f in fields], _code()]).encode()).hexdigest()
    entries = _read(path)
    if key in entries:
        return entries[key]
    value = compute()
    entries[key] = value
    if len(entries) > MAX_ENTRIES:
        entries = dict(list(entries.items())[len(entries) // 2 :])
    _write(path, entries)
    return value


def _path() -> Path | None:
    where = os.environ.get("SCALETRAIN_CACHE", "")
    if where.lower() == "off":
        return None
    return Path(where or Path.home() / ".cache" / "scaletrain") / FILE


@cache
def _code() -> str:
    """torch's version and a hash of the sources that decide what a trace finds."""
    import torch

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(torch.__version__.encode())
    for f in sorted([*root.joinpath("models").glob("*.py"), *root.joinpath("plan").glob("*.py")]):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _read(path: Path) -> dict[str, Any]:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(path: Path, entries: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
