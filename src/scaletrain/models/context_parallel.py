"""Context parallel by all-gathered keys and values (parallel.cp; as Llama 3 was trained).

The sequence of every sample is cut into 2 x cp chunks of equal length; rank i of a cp
group holds chunks i and 2cp - 1 - i, so that under the causal mask every rank has the
same attention work (an early chunk, which attends to little, with a late one, which
attends to much). Every rank of the group reads the same sample; the model embeds only
its own chunks, with their global positions for RoPE, and in each attention layer
all-gathers the keys and values of the whole sequence (small under grouped-query
attention: n_kv_heads of n_heads) with torch's autograd-aware functional collective
(its backward reduce-scatters the keys' and values' gradients), then attends with its own
queries: chunk g's queries see the keys of positions up to their own, which is
`causal_lower_right` over the first (g + 1) chunks, the form the flash and cuDNN kernels
take on CUDA. The targets are cut the same way (`local`), so the loss of a rank is the
mean over its tokens and the gradient reduction over dp x cp makes the mean of all.

Under document masking (models/documents.py) the documents are found in the whole
sample before the cut, and the mask of the local queries against all keys follows the
chunks (a boolean mask: the same numbers on any device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its cp group."""

    group: Any  # the cp process group
    rank: int
    size: int

    def chunks(self) -> tuple[int, int]:
        """The global chunk indices this rank holds, in the order it holds them."""
        return self.rank, 2 * self.size - 1 - self.rank

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The global positions this rank holds, in order: [2 x seq_len / (2 cp)]."""
        c = chunk_length(seq_len, self.size)
        return torch.cat([torch.arange(g * c, (g + 1) * c, device=device) for g in self.chunks()])

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a [B, T, ...] tensor (the targets)."""
        return x[:, self.positions(x.shape[1], x.device)].contiguous()

    def gather(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """[B, heads, local T, hd] on every rank -> [B, heads, T, hd] in global order
        (`order`: global_order's, made once per forward, not per layer)."""
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        gathered = all_gather_tensor_autograd(x.contiguous(), gather_dim=2, group=self.group)
        return gathered.index_select(2, order)

    def global_order(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Where the gathered tensor holds each global position. Gathered: rank r's
        (chunk r, chunk 2cp - 1 - r) at [r 2c, (r + 1) 2c)."""
        c = local_len // 2
        starts = []
        for g in range(2 * self.size):
            r, slot = (g, 0) if g < self.size else (2 * self.size - 1 - g, 1)
            starts.append(torch.arange(r * 2 * c + slot * c, r * 2 * c + (slot + 1) * c, device=device))
        return torch.cat(starts)

    def attention(self, seq_len: int, held: torch.Tensor, doc: torch.Tensor | None) -> SplitAttention:
        """What each attention layer takes: causal, or within documents `doc` [B, T]."""
        mask = None
        if doc is not None:
            keys = torch.arange(seq_len, device=held.device)
            same = doc[:, held, None] == doc[:, None, :]  # [B, local T, T]
            mask = (same & (keys[None, None, :] <= held[None, :, None]))[:, None]
        return SplitAttention(self, chunk_length(seq_len, self.size), mask, self.global_order(len(held), held.device))


class SequenceAttention:
    """What attention layers take (models/documents.py `attend`) where the sequence is split
    over ranks: called with this rank's q, k, v [B, heads, local T, hd], it returns this
    rank's output. Two designs: SplitAttention here (keys and values all-gathered) and
    models/ulysses.py's HeadAttention (heads and sequence swapped by all-to-all)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class SplitAttention(SequenceAttention):
    cp: ContextParallel
    chunk: int  # tokens per chunk
    mask: torch.Tensor | None  # under document masking: [B, 1, local T, T]
    order: torch.Tensor  # ContextParallel.global_order, for every layer's gathers

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        # Here, not at the top: torch.nn.attention.bias imports torch._dynamo (~0.5 s a process).
        from torch.nn.attention.bias import causal_lower_right

        k, v = self.cp.gather(k, self.order), self.cp.gather(v, self.order)
        if self.mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)
        c, out = self.chunk, []
        for i, g in enumerate(self.cp.chunks()):
            end = (g + 1) * c  # the keys up to the chunk's end; the last c of them are its own
            bias = causal_lower_right(c, end)
            out.append(
                F.scaled_dot_product_attention(
                    q[:, :, i * c : (i + 1) * c], k[:, :, :end], v[:, :, :end], attn_mask=bias, enable_gqa=gqa
                )
            )
        return torch.cat(out, dim=2)


def chunk_length(seq_len: int, cp: int) -> int:
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into 2 x cp = {2 * cp} equal chunks")
    return seq_len // (2 * cp)
