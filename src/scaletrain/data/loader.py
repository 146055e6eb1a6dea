"""Packed, shuffled, resumable training samples from a prepared token directory.

The whole data position is one integer, the global sample index. Sample g belongs to epoch
g // samples_per_epoch; within an epoch the shards are concatenated in a (seed, epoch)
permutation, cut into windows of seq_len + 1 tokens with stride seq_len, and the windows are
visited in a second (seed, epoch) permutation. Every rank derives the same mapping from the
same numbers, so no rank ever needs to talk to another about data, and resuming (with any
data-parallel size) only needs the position. Under eval.split the held-out documents are
cut out of each shard first (data/heldout.py), by the same rule on every rank.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:  # torch is imported on first use: `scaletrain data prepare` never needs it
    import torch

from scaletrain.data.blocks import is_url
from scaletrain.data.heldout import split_documents
from scaletrain.data.prepare import CONTEXT_BIT, MANIFEST, check_manifest
from scaletrain.data.remote import RemoteDataset, StoreOptions
from scaletrain.errors import UserError


class PackedTokens:
    """Random access to the packed windows of a prepared dataset (memory-mapped, read-only)."""

    def __init__(
        self, dataset_dir: Path | str, seq_len: int, seed: int, held_out: float = 0.0, store: StoreOptions | None = None
    ):
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        if self.seq_len < 1:
            raise UserError(f"data.seq_len = {seq_len} is invalid; accepted: an integer >= 1")
        # A URL (data.paths=["s3://bucket/prefix"]): the same directory in object storage,
        # read range by range through a block cache (data/remote.py), never copied whole.
        self.remote: RemoteDataset | None = None
        if is_url(dataset_dir):
            self.remote = RemoteDataset(str(dataset_dir), store or StoreOptions())
            if held_out > 0:
                raise UserError(
                    f"eval.split={held_out:g} reads every shard whole to find its documents, not from {dataset_dir} "
                    "(not built yet); accepted: eval.split=0 with eval.data, or a local copy of the data"
                )
        self.dir: Any = self.remote.url if self.remote else Path(dataset_dir)
        self.manifest = self.remote.manifest if self.remote else _read_manifest(Path(dataset_dir))
        m = self.manifest
        self.vocab_size: int = int(m["vocab_size"])
        self.eos_id: int = int(m["eos_id"])
        self.tokenizer_path: Path = self.remote.tokenizer if self.remote else self.dir / m["tokenizer"]
        self.dtype = np.dtype(m["dtype"]).newbyteorder("<")  # prepare writes little-endian
        # Fine-tuning records: tokens with CONTEXT_BIT are context, their targets not trained.
        self.masked = bool(m.get("loss_mask", False))

        self._shards: list[Any] = [*self.remote.shards(self.dtype)] if self.remote else self._local_shards()
        self._lengths = np.array([len(a) for a in self._shards], dtype=np.int64)
        self.total_tokens = int(self._lengths.sum())
        if self.total_tokens != int(m["total_tokens"]):
            raise UserError(
                f"{self.dir}: shards hold {self.total_tokens} tokens but {MANIFEST} says {m['total_tokens']}; prepare the data again"
            )
        # eval.split: the held-out documents leave each shard (data/heldout.py); without it
        # every shard is one piece, and the stream is exactly what it always was.
        self.split = split_documents(self._shards, self.eos_id, held_out, self.seed) if held_out > 0 else None
        self._pieces: list[list[Any]] = self.split.train if self.split else [[a] for a in self._shards]
        self.train_tokens = sum(len(p) for pieces in self._pieces for p in pieces)
        # The last window needs one token beyond its seq_len inputs (the final target).
        self.samples_per_epoch = (self.train_tokens - 1) // self.seq_len
        if self.samples_per_epoch < 1:
            left = f" ({self.train_tokens} once eval.split={held_out:g} held documents out)" if self.split else ""
            raise UserError(
                f"{self.dir}: {self.total_tokens} tokens{left} are too few for data.seq_len = {self.seq_len}; "
                f"accepted: seq_len <= {max(self.train_tokens - 1, 0)} for this data, or more data"
            )
        # The tokens themselves, not where they came from: the shards' checksums in order.
        self.fingerprint = hashlib.sha256("".join(s["sha256"] for s in m["shards"]).encode()).hexdigest()[:16]
        # Only the current epoch's permutations are kept: consumers walk indices in order.
        self._epoch: int | None = None
        self._starts = np.zeros(0, dtype=np.int64)
        self._order: list[Any] = []  # pieces: arrays, or RemoteShard objects
        self._perm = np.zeros(0, dtype=np.int64)

    def _local_shards(self) -> list[Any]:
        m, shards = self.manifest, []
        self._entries: list[dict[str, Any]] = []  # the manifest's entry of each shard kept
        for s in m["shards"]:
            path = self.dir / s["file"]
            if not path.is_file():
                raise UserError(f"{self.dir}: shard {s['file']} listed in {MANIFEST} is missing; prepare the data again")
            expected = int(s["tokens"]) * self.dtype.itemsize
            actual = path.stat().st_size
            if actual != expected:
                raise UserError(
                    f"{path}: {actual} bytes but {MANIFEST} says {s['tokens']} {m['dtype']} tokens ({expected} bytes); "
                    "the directory is damaged or mixed with another dataset, prepare the data again"
                )
            if s["tokens"] > 0:
                shards.append(np.memmap(path, dtype=self.dtype, mode="r", shape=(int(s["tokens"]),)))
                self._entries.append(s)
        return shards

    # -- epoch layout --------------------------------------------------------------------

    def _layout(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        # One generator per (seed, epoch): any rank, any time, derives the same layout.
        rng = np.random.default_rng([self.seed, epoch])
        shard_order = rng.permutation(len(self._shards))
        self._order = [piece for i in shard_order for piece in self._pieces[i] if len(piece)]
        self._shard_order = shard_order
        self._starts = np.concatenate([[0], np.cumsum([len(piece) for piece in self._order])]).astype(np.int64)
        self._perm = rng.permutation(self.samples_per_epoch)
        self._epoch = epoch

    def documents(self, held: bool) -> list[np.ndarray]:
        """The held-out documents' tokens (eval.split; none without it), or else the tokens
        training reads, in the manifest's order (slices of the shards, not copies)."""
        if held:
            return self.split.held if self.split else []
        return [piece for pieces in self._pieces for piece in pieces]

    def shard_order(self, epoch: int) -> list[int]:
        """Indices into the manifest's shard list, in the order epoch `epoch` concatenates them."""
        self._layout(epoch)
        return [int(i) for i in self._shard_order]

    def sample_id(self, global_index: int) -> tuple[int, int]:
        """(epoch, window index in that epoch's concatenated stream) of a global sample."""
        if global_index < 0:
            raise IndexError(f"global sample index {global_index} is negative")
        epoch, within = divmod(int(global_index), self.samples_per_epoch)
        self._layout(epoch)
        return epoch, int(self._perm[within])

    def sample(self, global_index: int) -> np.ndarray:
        """seq_len + 1 tokens (int64): inputs are [:-1], targets [1:]."""
        _, window = self.sample_id(global_index)
        return self._read(window * self.seq_len, self.seq_len + 1)

    def batch(self, global_indices: range | list[int] | np.ndarray) -> np.ndarray:
        """(len(indices), seq_len + 1) int64 array of samples; equals stacking sample(g).

        Vectorized: windows inside one shard are gathered with one fancy index per shard,
        only the rare windows that span a shard boundary go through the scalar path.
        """
        idx = np.asarray(global_indices, dtype=np.int64).reshape(-1)
        n = self.seq_len + 1
        out = np.empty((idx.size, n), dtype=np.int64)
        if idx.size == 0:
            return out
        if idx.min() < 0:
            raise IndexError(f"global sample index {int(idx.min())} is negative")
        epochs, within = np.divmod(idx, self.samples_per_epoch)
        for epoch in np.unique(epochs):  # usually one; two when a step crosses an epoch end
            rows = np.nonzero(epochs == epoch)[0]
            self._layout(int(epoch))
            starts = self._perm[within[rows]] * self.seq_len
            shard = np.searchsorted(self._starts, starts, side="right") - 1
            inside = starts + n <= self._starts[shard + 1]
            for s in np.unique(shard[inside]):
                sel = inside & (shard == s)
                offsets = starts[sel] - self._starts[s]
                piece = self._order[s]
                out[rows[sel]] = piece.windows(offsets, n) if self.remote else piece[offsets[:, None] + np.arange(n)]
            for r in np.nonzero(~inside)[0]:
                out[rows[r]] = self._read(int(starts[r]), n)
        return out

    def _read(self, start: int, n: int) -> np.ndarray:
        # Windows may span shard boundaries: locate the shard by its cumulative start offset.
        out = np.empty(n, dtype=np.int64)
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        filled = 0
        while filled < n:
            shard = self._order[i]
            offset = start + filled - int(self._starts[i])
            take = min(n - filled, len(shard) - offset)
            out[filled : filled + take] = shard[offset : offset + take]
            filled += take
            i += 1
        return out

    def read_ahead(self, global_indices: range) -> None:
        """From object storage: start fetching these samples' blocks in the background (the
        next step's, while this one computes); on a local disk nothing to do."""
        if self.remote is None or not len(global_indices):
            return
        wanted = []
        n = self.seq_len + 1
        for g in global_indices:
            _, window = self.sample_id(g)
            start = window * self.seq_len
            i = int(np.searchsorted(self._starts, start, side="right")) - 1
            while start < window * self.seq_len + n and i < len(self._order):  # a window may span shards
                offset = start - int(self._starts[i])
                take = min(window * self.seq_len + n - start, len(self._order[i]) - offset)
                wanted += self._order[i].ranges([offset], take)
                start, i = start + take, i + 1
        self.remote.cache.ahead(wanted)

    def origin(self, first: int, stop: int, most: int = 16) -> list[dict[str, Any]]:
        """Where the global samples [first, stop) came from (at most `most` of them): each
        one's shard and token offset in it and, where the manifest records its sources
        (`data prepare` since train.spikes), the input file, the document's number in that
        file (its n-th non-empty document, from 0) and the token's offset in the document.
        Data in object storage: the sample's index alone."""
        rows = []
        for g in range(first, min(stop, first + most)):
            row: dict[str, Any] = {"sample": g}
            start = self.sample_id(g)[1] * self.seq_len
            i = int(np.searchsorted(self._starts, start, side="right")) - 1
            at = self._in_shard(self._order[i], start - int(self._starts[i]))
            if at is not None:
                row |= self._document(*at)
            rows.append(row)
        return rows

    def _in_shard(self, piece: Any, offset: int) -> tuple[int, int] | None:
        """(index of the shard kept, token offset in it) of `offset` into `piece`: a shard
        itself, or a slice of one (eval.split's training pieces are views of the memmaps)."""
        if self.remote is not None:
            return None
        for k, shard in enumerate(self._shards):
            if piece is shard:
                return k, offset
            if np.may_share_memory(piece, shard):
                base = piece.__array_interface__["data"][0] - shard.__array_interface__["data"][0]
                return k, base // shard.itemsize + offset
        return None

    def _document(self, k: int, offset: int) -> dict[str, Any]:
        entry, shard = self._entries[k], self._shards[k]
        row: dict[str, Any] = {"shard": entry["file"], "offset": offset}
        sources, before = self.manifest.get("sources"), entry.get("documents_before")
        if not sources or before is None:
            return row
        ends = np.flatnonzero(np.asarray(shard[:offset]) == self.eos_id)
        document = int(before) + len(ends)  # EOS ends each document: those before the token
        if len(ends):  # else the document began in an earlier shard
            row["in_document"] = offset - int(ends[-1]) - 1
        for source in sources:
            if document < source["documents"]:
                return row | {"file": source["path"], "document": document}
            document -= source["documents"]
        return row

    def verify(self) -> None:
        """Check every shard's sha256 against the manifest (reads all data; optional)."""
        for s in self.manifest["shards"]:
            if self.remote:
                h = self.remote.sha256(s["file"])
                if h != s["sha256"]:
                    raise UserError(f"{self.dir}/{s['file']}: checksum differs from {MANIFEST}; prepare the data again")
                continue
            h = hashlib.sha256((self.dir / s["file"]).read_bytes()).hexdigest()
            if h != s["sha256"]:
                raise UserError(f"{self.dir / s['file']}: checksum differs from {MANIFEST}; prepare the data again")


def _read_manifest(d: Path) -> dict[str, Any]:
    path = d / MANIFEST
    if not path.is_file():
        raise UserError(f"{str(d)!r} has no {MANIFEST}; accepted: a directory made by `scaletrain data prepare`")
    return check_manifest(path.read_text(), str(path))


class Samples(Protocol):
    """What RankBatches reads: a PackedTokens, or a mixture of them (data/mix.py's DataMix)."""

    masked: bool  # some tokens carry CONTEXT_BIT (fine-tuning records)

    def batch(self, global_indices: range | list[int] | np.ndarray) -> np.ndarray: ...


def split_sample(t: torch.Tensor, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples [n, seq_len + 1] -> (inputs, targets) [n, seq_len]; under `masked` the
    context tokens' marks come off and their targets become the ignored index."""
    if not masked:
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
    import torch

    from scaletrain.models.loss import IGNORE_INDEX

    context = (t & CONTEXT_BIT) != 0
    tokens = t & (CONTEXT_BIT - 1)
    targets = torch.where(context[:, 1:], IGNORE_INDEX, tokens[:, 1:])
    return tokens[:, :-1].contiguous(), targets.contiguous()


def trained_targets(samples: np.ndarray) -> int:
    """How many targets of `samples` [n, seq_len + 1] are trained (not context)."""
    return int(np.count_nonzero((samples[:, 1:] & CONTEXT_BIT) == 0))


class RankBatches:
    """The micro-batches one data-parallel rank trains on, step by step.

    A step consumes micro_batch * grad_accum * dp_size global samples starting at `position`.
    Micro-batch m of rank r takes position + (m * dp_size + r) * micro_batch + [0, micro_batch).
    Hence for one step, concatenating ranks within a micro-batch and then micro-batches gives a
    contiguous range: world 2 x micro 2 equals world 1 x micro 4, and accumulation 4 x micro 2
    equals one micro-batch of 8, which keeps losses comparable across layouts.
    """

    def __init__(self, data: Samples, micro_batch: int, grad_accum: int, dp_rank: int, dp_size: int, start: int = 0):
        if micro_batch < 1 or grad_accum < 1 or dp_size < 1:
            raise ValueError(f"micro_batch={micro_batch}, grad_accum={grad_accum}, dp_size={dp_size} must all be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, {dp_size})")
        if start < 0:
            raise ValueError(f"start={start} must be >= 0")
        self.data = data
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = int(start)  # global index where the next optimizer step starts
        self.masked = bool(getattr(data, "masked", False))
        # Under `masked`, the trained targets of the last step on all ranks together: what the
        # loss of a step of fine-tuning records is the mean over (each rank reads the whole
        # step to count them: no collective, the same number at any world size).
        self.step_tokens = 0

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp_size

    def step_indices(self) -> list[range]:
        """This rank's global sample indices of each micro-batch of the next step."""
        return [
            range(b, b + self.micro_batch)
            for m in range(self.grad_accum)
            for b in [self.position + (m * self.dp_size + self.dp_rank) * self.micro_batch]
        ]

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """grad_accum (inputs, targets) pairs of int64 (micro_batch, seq_len); advances position."""
        import torch

        out = []
        if self.masked:
            whole = self.data.batch(range(self.position, self.position + self.samples_per_step))
            self.step_tokens = trained_targets(whole)
            for idx in self.step_indices():
                out.append(split_sample(torch.from_numpy(whole[idx.start - self.position : idx.stop - self.position]), True))
        else:
            for idx in self.step_indices():
                out.append(split_sample(torch.from_numpy(self.data.batch(idx)), False))
        self.position += self.samples_per_step
        # From object storage: the next step's samples are fetched while this step computes.
        ahead = getattr(self.data, "read_ahead", None)
        if ahead is not None:
            steps = [range(self.position, self.position + self.samples_per_step)] if self.masked else self.step_indices()
            for idx in steps:
                ahead(idx)
        return out
