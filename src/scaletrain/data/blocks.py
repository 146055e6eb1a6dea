"""What the prepared format and its readers of byte ranges share (data/prepare.py writes,
data/remote.py reads): the block size, each block's checksum, and what counts as a URL."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

BLOCK_BYTES = 1 << 16  # 64 KiB: one or two per window of a few thousand tokens; a CRC-32 each


def is_url(path: str | Path) -> bool:
    return isinstance(path, str) and "://" in path


def block_checksums(data: bytes | memoryview, block: int = BLOCK_BYTES) -> bytes:
    """The CRC-32 of each `block` bytes of `data` (the last may be shorter), little-endian uint32."""
    view = memoryview(data)
    return np.array([zlib.crc32(view[i : i + block]) for i in range(0, len(view), block)], dtype="<u4").tobytes()
