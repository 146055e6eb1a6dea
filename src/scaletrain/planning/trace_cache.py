"""The planner's activation traces kept across processes.

Tracing what a block saves for backward runs the block under FakeTensorMode, whose first
use imports torch._dynamo and torch._inductor: ~0.45 s of a core in every process that
plans (rank 0 of each run, `scaletrain plan`), for a handful of integers that depend only
on the model, the trace's shape, the precision regime, torch and scaletrain's own model
and planner code. So each result is kept (disk_cache.py: a small JSON file
per entry under `$SCALETRAIN_CACHE` or `~/.cache/scaletrain`, `activation-traces/`), keyed by
all of those (the code by a hash of its source files): a later process with the same key
reads it instead of tracing. A key that changes (another torch, edited model code) misses and
traces again. Any I/O problem (a read-only home) just means tracing, as without the cache;
`SCALETRAIN_CACHE=off` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from scaletrain import disk_cache

FILE = "activation-traces"


# The clock's operation traces (planning/clock/trace.py), larger, in a file of their own.
OPS_FILE = "clock-traces"


def cached(kind: str, fields: tuple[Any, ...], compute: Callable[[], Any], file: str = FILE) -> Any:
    """compute(), or its earlier result for the same (kind, fields) and code."""
    return disk_cache.cached(file, [kind, [repr(f) for f in fields], _code()], compute)


@cache
def _code() -> str:
    """torch's and transformers' versions and a hash of the sources that decide what a trace
    finds (a Hugging Face model's block is transformers' code: its masks, its kernels' calls)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(torch.__version__.encode())
    with contextlib.suppress(PackageNotFoundError):
        h.update(version("transformers").encode())
    for f in sorted([*root.joinpath("models").glob("*.py"), *root.joinpath("planning").rglob("*.py")]):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()
