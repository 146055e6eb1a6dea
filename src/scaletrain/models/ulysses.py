"""Context parallel by all-to-all over heads (parallel.cp_mode=ulysses; DeepSpeed-Ulysses,
Jacobs et al. 2023, the design of DeepSpeed's Arctic long-sequence training).

Rank r of a cp group holds the contiguous positions [r T/cp, (r + 1) T/cp) of every
sample: it embeds them, runs every per-token layer (norms, projections, feed-forward, the
head and the loss) on them alone. Around each attention two all-to-alls swap what is
split: before it, every rank sends each other rank that rank's share of the heads for
its own positions, and receives its own share of the heads for all positions, so it
attends over the whole sequence with 1/cp of the heads (plain causal, or the documents'
mask of the whole sample: no chunk bookkeeping); after it, the inverse all-to-all gives
every rank all heads of its own positions back. The all-to-alls are torch's
autograd-aware functional collective: their backward is the inverse exchange.

Traffic per attention and rank: q, k, v and the output, each 1/cp of a local tensor
sent to every other rank, (cp - 1)/cp of 2 x (hidden + kv width) x local tokens: it
shrinks with cp, where the all-gather design's keys and values grow with the whole
sequence. The price: the heads must divide over cp. Key/value heads fewer than cp (or
not divisible by it) are repeated first, each as often as the smallest factor that
makes their count a multiple of cp, which keeps every query head with its own group's
keys (`kv_repeat`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from scaletrain.models.context_parallel import SequenceAttention
from scaletrain.models.documents import attend, document_mask, window_mask


def kv_repeat(n_kv_heads: int, cp: int) -> int:
    """How often each key/value head is repeated so that their count divides over cp."""
    return cp // math.gcd(n_kv_heads, cp)


def heads_problem(n_heads: int, n_kv_heads: int, cp: int, tp: int = 1) -> str | None:
    """Why `cp` Ulysses ranks cannot split these heads, or None. Under tensor parallel
    each rank holds n_heads / tp of them (and n_kv_heads / tp: llama_tp checks both divide),
    and those are what the cp ranks split. The key/value heads need no check of their own:
    they divide the query heads, so their repeated count lcm(n_kv_heads, cp) divides
    n_heads too, and query head j keeps its group's key head."""
    if n_heads % tp or (n_heads // tp) % cp:
        held = f"each tp rank's {n_heads // tp} of the {n_heads}" if tp > 1 else f"the {n_heads}"
        return f"{held} attention heads do not divide over cp={cp} ranks"
    return None


@dataclass(frozen=True)
class Ulysses:
    """This rank's place in its cp group (the interface of ContextParallel)."""

    group: Any  # the cp process group
    rank: int
    size: int
    tp: int = 1  # parallel.tp: each rank's attention holds n_heads / tp of the heads, which the cp ranks split

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The global positions this rank holds, in order: one contiguous run."""
        if seq_len % self.size:
            raise ValueError(f"a sequence of {seq_len} tokens does not cut into cp={self.size} equal runs")
        n = seq_len // self.size
        return torch.arange(self.rank * n, (self.rank + 1) * n, device=device)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a [B, T, ...] tensor (the targets)."""
        n = x.shape[1] // self.size
        return x[:, self.rank * n : (self.rank + 1) * n].contiguous()

    def attention(self, seq_len: int, held: torch.Tensor, doc: torch.Tensor | None) -> HeadAttention:
        """What each attention layer takes: causal, or within documents `doc` [B, T] (the
        whole sample's: every rank attends over all positions)."""
        return HeadAttention(self, None if doc is None else document_mask(doc))

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, T/cp, hd] (all heads, own positions) -> [B, H/cp, T, hd] (own heads, all positions)."""
        b, h, n, d = x.shape
        # Rank s gets heads [s H/cp, (s + 1) H/cp): the exchange runs along dim 0.
        parts = x.reshape(b, self.size, h // self.size, n, d).transpose(0, 1).contiguous()
        got = self._exchange(parts)  # [source rank = its positions' run, B, H/cp, T/cp, hd]
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // self.size, self.size * n, d)

    def to_positions(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse: [B, H/cp, T, hd] -> [B, H, T/cp, hd]."""
        b, h, t, d = x.shape
        # Rank s gets positions [s T/cp, (s + 1) T/cp) of my heads.
        parts = x.reshape(b, h, self.size, t // self.size, d).permute(2, 0, 1, 3, 4).contiguous()
        got = self._exchange(parts)  # [source rank = its heads' share, B, H/cp, T/cp, hd]
        return got.transpose(0, 1).reshape(b, h * self.size, t // self.size, d)

    def _exchange(self, parts: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        return all_to_all_single_autograd(parts, None, None, self.group)


@dataclass(frozen=True)
class HeadAttention(SequenceAttention):
    sp: Ulysses
    mask: Any  # None (causal), or the whole sample's documents' mask (models/documents.py)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        repeat = kv_repeat(k.shape[1], self.sp.size)
        if repeat > 1:  # query head j keeps key head j // (H / Hkv): see heads_problem
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        q, k, v = self.sp.to_heads(q), self.sp.to_heads(k), self.sp.to_heads(v)
        out = attend(q, k, v, self.mask, gqa=q.shape[1] != k.shape[1])
        return self.sp.to_positions(out)


HF_ATTENTION = "scaletrain_ulysses"  # its name in transformers' AttentionInterface


def hf_attention(sp: Ulysses) -> Any:
    """An attention function for transformers' AttentionInterface: q [B, H, T/cp, hd] and
    k, v [B, Hkv, T/cp, hd] of this rank's positions (rotated at their global positions) ->
    (the output [B, T/cp, H, hd], no weights), causal over the whole sequence with the
    model's own scaling. transformers builds no mask for a name its mask interface lacks,
    so none is given; every layer is causal over all positions, or, where the layer passes
    its `sliding_window` (Mistral's, Qwen2's sliding layers), within that window of them
    (documents.window_mask: the same whole-sequence positions on every rank)."""
    import torch.nn.functional as F

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        repeat = kv_repeat(key.shape[1], sp.size)
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        q, k, v = sp.to_heads(query), sp.to_heads(key), sp.to_heads(value)
        gqa, t, window = q.shape[1] != k.shape[1], q.shape[2], kwargs.get("sliding_window")
        if window and window < t:  # (apply_cp refuses a window with attention dropout: the block mask takes none)
            out = attend(q, k, v, window_mask(t, int(window), q.device), gqa, scale=scaling)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        return sp.to_positions(out).transpose(1, 2).contiguous(), None

    return attention
