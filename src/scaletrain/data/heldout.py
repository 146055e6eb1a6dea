"""Documents held out of training for evaluation (eval.split), and the windows an evaluation reads.

A document is what `data prepare` wrote between two eos tokens, its eos included (prepare
ends every document with one), numbered 0, 1, 2, ... in the manifest's order over all
shards (a document split across a shard boundary keeps its number on both sides).
Document i is held out when a 64-bit hash of (train.seed, i) falls below the fraction:
the choice needs no other document, no world size and no position, so every rank, every
resume and `scaletrain eval` at any world size draws the same documents.

The training stream keeps its layout (data/loader.py: each epoch concatenates the shards in
a seeded order) with the held-out documents cut out of each shard; the eval stream is the
held-out documents in document order, read as consecutive windows: a fixed set, in a fixed
order, whatever the seed's epoch shuffles do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# splitmix64's mixing function (Steele, Lea & Flood 2014): consecutive indices give independent-looking bits.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def held_out(documents: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """Which of these document indices are held out (bool per index)."""
    x = documents.astype(np.uint64) + np.uint64(seed * int(_GOLDEN) % 2**64)  # arrays of uint64 wrap silently
    for shift, mult in ((30, _MIX1), (27, _MIX2)):
        x = (x ^ (x >> np.uint64(shift))) * mult
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53 < fraction


@dataclass
class DocumentSplit:
    train: list[list[np.ndarray]]  # per shard (manifest order): its training documents, as slices of it
    held: list[np.ndarray]  # the held-out documents' tokens, in document order (slices of the shards)
    documents: int
    held_documents: int


def split_documents(shards: Sequence[np.ndarray], eos_id: int, fraction: float, seed: int) -> DocumentSplit:
    """Cut every shard into runs of training and of held-out documents (views, no copy)."""
    train: list[list[np.ndarray]] = []
    held: list[np.ndarray] = []
    doc = 0  # the number of the document the current shard starts in
    for shard in shards:
        ends = np.flatnonzero(np.asarray(shard) == eos_id) + 1  # a document ends after its eos
        cuts = np.concatenate([[0], ends, [len(shard)]]).astype(np.int64)
        cuts = cuts[np.concatenate([[True], cuts[1:] != cuts[:-1]])]  # no empty piece (a shard ending in eos)
        out = held_out(doc + np.arange(len(cuts) - 1), seed, fraction)
        if not len(out):  # an empty shard
            train.append([])
            continue
        # Runs of neighbouring documents on the same side, each one slice of the shard.
        change = np.flatnonzero(out[1:] != out[:-1]) + 1
        mine: list[np.ndarray] = []
        for a, b in zip(np.concatenate([[0], change]), np.concatenate([change, [len(out)]])):
            (held if out[a] else mine).append(shard[cuts[a] : cuts[b]])
        train.append(mine)
        doc += len(ends)
    documents = doc + int(_tail(shards, eos_id))
    return DocumentSplit(train, held, documents, int(held_out(np.arange(documents), seed, fraction).sum()))


def _tail(shards: Sequence[np.ndarray], eos_id: int) -> bool:
    """Tokens after the last eos (a dataset not written by prepare): one more document."""
    for shard in reversed(shards):
        if len(shard):
            return bool(shard[-1] != eos_id)
    return False


class Windows:
    """Consecutive windows of seq_len + 1 tokens (stride seq_len) over pieces read in order:
    window k is tokens [k seq_len, k seq_len + seq_len + 1) of their concatenation."""

    def __init__(self, pieces: Sequence[np.ndarray], seq_len: int):
        self.pieces = [p for p in pieces if len(p)]
        self.seq_len = seq_len
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in self.pieces])]).astype(np.int64)
        self.tokens = int(self.starts[-1])
        self.count = max(0, (self.tokens - 1) // seq_len)

    def batch(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """(len(indices), seq_len + 1) int64."""
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        for row, k in enumerate(indices):
            out[row] = self._read(int(k) * self.seq_len, self.seq_len + 1)
        return out

    def _read(self, start: int, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.int64)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        filled = 0
        while filled < n:
            offset = start + filled - int(self.starts[i])
            take = min(n - filled, len(self.pieces[i]) - offset)
            out[filled : filled + take] = self.pieces[i][offset : offset + take]
            filled += take
            i += 1
        return out
