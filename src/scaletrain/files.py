"""Files written whole or not at all, for every package (checkpoints' small files, the
out-of-memory records, reports): no torch, no other scaletrain module."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """`text` to `path` through a temporary file beside it, flushed to the disk before it
    replaces the old one: a reader, or a run killed meanwhile, sees the old file or the new."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
