"""Data mixtures (`data.mix`): several prepared sources interleaved by weight.

The data position stays one global sample index g. A mixture maps g to (source s, index k
within s) by a pure function of g and the weights, and k is then that source's own global
sample index: its PackedTokens shuffles it with the run's seed and counts its epochs (index
k of a source of N windows per epoch is in its epoch k // N). Nothing is carried from one
sample to the next, so every rank computes the same mapping without talking, a resume
needs only the position, and any data-parallel size reads the same global stream.

The mapping: a block of B samples repeats forever. Each source gets q_s of the block's
slots: the weights' exact ratio where it is one of small integers (0.7/0.3 gives B = 10
with 7 and 3 slots; three equal weights B = 3), otherwise the largest remainders of
w_s x 16384 (then the long-run share is within 1/16384 of the weight). Inside the block
the slots are dealt by the greedy rule of Megatron-LM's dataset blend: slot n goes to the
source furthest behind its target, argmax_s q_s (n + 1) / B - count_s (integer arithmetic,
ties to the lower index). That keeps every source's count within one sample of its share
at every prefix of every block (|count_s(n) - n q_s / B| < 1, checked when the block is
built), so the realised proportion is right from the first global batch on, not only on
average. Then

    g = b B + r:   s = slot[r],   k = b q_s + (the slots of s before r in the block),

so k advances by exactly one each time s is chosen (contiguously, from 0), and the count
of each source among the first n samples is closed-form (what telemetry reports).

Why no seeded shuffle of the slots: each source's samples already come in its own seeded
random order, so shuffling the interleave adds nothing to the data's randomness; it only
adds prefix error (a random permutation of a block of 100 samples at 70/30 is off by
1.8 samples on average after its first 50, the greedy by at most 0.5 anywhere). The seed
enters through the sources, as it does for data.paths; a one-source mixture is exactly
the plain run's stream.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.data.blocks import is_url
from scaletrain.data.loader import PackedTokens
from scaletrain.data.prepare import TOKENIZER_FILE, ensure_prepared, resolve_dataset_dir
from scaletrain.data.remote import RemoteDataset, store_options
from scaletrain.errors import UserError

MAX_BLOCK = 1 << 14  # the block when the weights are no ratio of small integers


def block_quotas(weights: Sequence[float]) -> np.ndarray:
    """Slots per source in one block (their sum is the block size B): exact for weights in
    a ratio of integers whose shares' common denominator is at most MAX_BLOCK, else the
    largest remainders of each share x MAX_BLOCK."""
    total = math.fsum(weights)
    shares = [w / total for w in weights]
    exact = [Fraction(x).limit_denominator(MAX_BLOCK) for x in shares]
    if sum(exact) == 1 and all(abs(f - x) <= 1e-12 for f, x in zip(exact, shares)):
        block = math.lcm(*(f.denominator for f in exact))
        if block <= MAX_BLOCK:
            return np.array([int(f * block) for f in exact], dtype=np.int64)
    raw = np.array(shares) * MAX_BLOCK
    quotas = np.floor(raw).astype(np.int64)
    extra = MAX_BLOCK - int(quotas.sum())
    quotas[np.argsort(-(raw - quotas), kind="stable")[:extra]] += 1  # ties to the lower index
    return quotas


def deal_block(quotas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The block's slots: the source of each slot, and how many of that source's slots
    came before it (Megatron-LM's greedy blend over one block, in exact integers)."""
    q = [int(x) for x in quotas]
    block = sum(q)
    counts = [0] * len(q)
    slot = np.empty(block, dtype=np.int64)
    before = np.empty(block, dtype=np.int64)
    for n in range(block):
        # Target minus count, both times B: (q_s (n + 1) - count_s B); max picks the first of ties.
        deficit = [qs * (n + 1) - c * block for qs, c in zip(q, counts)]
        s = deficit.index(max(deficit))
        slot[n], before[n] = s, counts[s]
        counts[s] += 1
        # The property the mapping promises (module doc): a broken deal must not train.
        assert all(abs(c * block - qs * (n + 1)) < block for qs, c in zip(q, counts)), (n, counts, q)
    assert counts == q, (counts, q)
    return slot, before


class DataMix:
    """The global sample stream of several PackedTokens sources, interleaved by weight.

    Offers what the loop and checkpoints read of PackedTokens (batch, sample, vocab_size,
    eos_id, fingerprint, samples_per_epoch), so RankBatches takes either."""

    def __init__(self, sources: Sequence[PackedTokens], weights: Sequence[float], names: Sequence[str] | None = None):
        if not sources or len(sources) != len(weights):
            raise ValueError(f"{len(sources)} sources and {len(weights)} weights: one weight per source, at least one")
        if any(not (math.isfinite(w) and w > 0) for w in weights):
            raise ValueError(f"weights {list(weights)} must all be finite and > 0")
        self.sources = list(sources)
        self.names = list(names) if names is not None else [f"data.mix[{i}]" for i in range(len(sources))]
        if len({s.seq_len for s in self.sources}) > 1:
            raise ValueError(f"sources cut into windows of {[s.seq_len for s in self.sources]} tokens: one seq_len for all")
        _same_tokens(self.sources, self.names)
        self.weights = [w / math.fsum(weights) for w in weights]
        self.quotas = block_quotas(weights)
        if (self.quotas == 0).any():
            i = int(np.nonzero(self.quotas == 0)[0][0])
            raise UserError(
                f"{self.names[i]}.weight = {weights[i]:g} is under 1/{MAX_BLOCK} of the total ({math.fsum(weights):g}): "
                f"the source would never be read; accepted: a larger weight, or no such source"
            )
        self.block = int(self.quotas.sum())
        self._slot, self._before = deal_block(self.quotas)
        # _seen[r, s]: the slots of source s among the block's first r (0 <= r <= B).
        onehot = np.zeros((self.block, len(self.sources)), dtype=np.int64)
        onehot[np.arange(self.block), self._slot] = 1
        self._seen = np.concatenate([np.zeros((1, len(self.sources)), dtype=np.int64), np.cumsum(onehot, axis=0)])

        first = self.sources[0]
        self.seq_len, self.vocab_size, self.eos_id = first.seq_len, first.vocab_size, first.eos_id
        self.masked = any(s.masked for s in self.sources)  # fine-tuning records in some source
        self.tokenizer_path = first.tokenizer_path
        self.samples_per_epoch = sum(s.samples_per_epoch for s in self.sources)  # all sources' windows once
        # Other tokens, or other weights, and the position means other samples (checkpoint/resume.py).
        key = {"sources": [s.fingerprint for s in self.sources], "quotas": self.quotas.tolist()}
        self.fingerprint = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

    def locate(self, global_indices: range | list[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source) of each global sample index."""
        g = np.asarray(global_indices, dtype=np.int64).reshape(-1)
        if g.size and g.min() < 0:
            raise IndexError(f"global sample index {int(g.min())} is negative")
        b, r = np.divmod(g, self.block)
        source = self._slot[r]
        return source, b * self.quotas[source] + self._before[r]

    def counts(self, n: int) -> np.ndarray:
        """How many of the first n global samples each source gave."""
        b, r = divmod(int(n), self.block)
        return b * self.quotas + self._seen[r]

    def batch(self, global_indices: range | list[int] | np.ndarray) -> np.ndarray:
        """(len(indices), seq_len + 1) int64 samples, each from its source's own stream."""
        source, index = self.locate(global_indices)
        out = np.empty((source.size, self.seq_len + 1), dtype=np.int64)
        for s in np.unique(source):
            rows = np.nonzero(source == s)[0]
            out[rows] = self.sources[s].batch(index[rows])
        return out

    def sample(self, global_index: int) -> np.ndarray:
        return self.batch([global_index])[0]

    def verify(self) -> None:
        for source in self.sources:
            source.verify()

    def shares(self, start: int, end: int) -> dict[str, Any]:
        """The "mix" field of an interval event (docs/data.md): what samples [start, end)
        and everything before `end` took from each source, and each source's epochs read."""
        total = self.counts(end)
        got = total - self.counts(start)
        return {
            "samples": got.tolist(),
            "share": [round(x, 4) for x in (got / max(int(got.sum()), 1)).tolist()],
            "total": total.tolist(),
            "total_share": [round(x, 4) for x in (total / max(int(total.sum()), 1)).tolist()],
            "target": [round(w, 4) for w in self.weights],
            "epochs": [round(int(t) / s.samples_per_epoch, 4) for t, s in zip(total, self.sources)],
        }


class MixShares:
    """Each log interval's "mix" field: the samples the steps since the previous call read
    (the position only moves forward: a rollback keeps it, training/saves.py)."""

    def __init__(self, mix: DataMix, position: Callable[[], int]):
        self.mix, self.position = mix, position
        self.last = position()

    def take(self) -> dict[str, Any]:
        now = self.position()
        out = self.mix.shares(self.last, now)
        self.last = now
        return out


def _same_tokens(sources: list[PackedTokens], names: list[str]) -> None:
    """One tokenizer for all: the same token id must mean the same text in every source."""
    first = _sha256(sources[0].tokenizer_path)
    for source, name in zip(sources[1:], names[1:]):
        if _sha256(source.tokenizer_path) != first:
            raise UserError(
                f"{name}: its tokenizer ({source.tokenizer_path}, vocabulary {source.vocab_size}) differs from {names[0]}'s "
                f"({sources[0].tokenizer_path}, vocabulary {sources[0].vocab_size}); accepted: sources tokenized with one "
                "tokenizer.json (data.tokenizer, or `scaletrain data prepare --tokenizer` for prepared directories)"
            )


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- config glue
#
# Each source is prepared as data.paths is (its own cache entry under data.dir), with one
# tokenizer: data.tokenizer, or else the first source's (trained on its text, or its
# prepared directory's), which every other text source is then tokenized with.


def _source_config(data_cfg: Any, i: int, tokenizer: str | None) -> Any:
    return data_cfg.model_copy(update={"paths": list(data_cfg.mix[i].paths), "mix": [], "tokenizer": tokenizer})


def _key(i: int) -> str:
    return f"data.mix[{i}].paths"


def _shared_tokenizer(data_cfg: Any) -> str | None:
    """The tokenizer the sources after the first are tokenized with (None: train one)."""
    if data_cfg.tokenizer is not None:
        return str(data_cfg.tokenizer)
    return str(tokens_dir(data_cfg) / TOKENIZER_FILE)


def tokens_dir(data_cfg: Any) -> Path:
    """The prepared directory whose tokenizer.json the run's tokens come from: data.paths',
    or a mixture's first source's (every source has the same)."""
    if not data_cfg.mix:
        where = resolve_dataset_dir(data_cfg)[0]
    else:
        where = resolve_dataset_dir(_source_config(data_cfg, 0, data_cfg.tokenizer), _key(0))[0]
    if is_url(where):  # in object storage: the directory of its tokenizer's local copy (data/remote.py)
        return RemoteDataset(where, store_options(data_cfg)).tokenizer.parent
    return Path(where)


def mix_to_prepare(data_cfg: Any) -> bool:
    """Every source's paths checked (the same one-line error on every rank); whether any
    source is text, tokenized into the cache under data.dir."""
    text = False
    for i in range(len(data_cfg.mix)):
        # The tokenizer only keys the cache entry; here the paths are judged.
        text |= resolve_dataset_dir(_source_config(data_cfg, i, data_cfg.tokenizer), _key(i))[1] is not None
    return text


def prepare_mix(data_cfg: Any, show_progress: bool = True) -> list[Path]:
    """Tokenize the sources not prepared yet, the first one first (its tokenizer may be
    every other's). Rank 0 only."""
    dirs = [_prepared(data_cfg, 0, data_cfg.tokenizer, show_progress)]
    shared = _shared_tokenizer(data_cfg)
    dirs += [_prepared(data_cfg, i, shared, show_progress) for i in range(1, len(data_cfg.mix))]
    return dirs


def _prepared(data_cfg: Any, i: int, tokenizer: str | None, show_progress: bool) -> Path:
    try:
        return ensure_prepared(_source_config(data_cfg, i, tokenizer), show_progress, what=_key(i))
    except UserError as e:  # e.g. "inputs hold no text": say which source
        raise UserError(str(e) if str(e).startswith(f"data.mix[{i}]") else f"data.mix[{i}]: {e}") from None


def open_mix(data_cfg: Any, seed: int, held_out: float = 0.0) -> DataMix:
    """The prepared sources as one mixture (after prepare_mix ran on rank 0); `held_out`
    (eval.split) leaves each source's held-out documents out of its stream, as for data.paths."""
    shared = _shared_tokenizer(data_cfg)
    sources = []
    for i, source in enumerate(data_cfg.mix):
        out = resolve_dataset_dir(_source_config(data_cfg, i, data_cfg.tokenizer if i == 0 else shared), _key(i))[0]
        try:
            sources.append(PackedTokens(out, data_cfg.seq_len, seed, held_out=held_out, store=store_options(data_cfg)))
        except UserError as e:  # e.g. too few tokens for seq_len
            raise UserError(f"data.mix[{i}] ({', '.join(source.paths)}): {e}") from None
    return DataMix(sources, [s.weight for s in data_cfg.mix])
