"""Document masking (`data.document_mask`): inside a packed sample, a token attends only to
the earlier tokens of its own document, and its rotary position counts from that
document's first token, so a sample of two documents computes exactly what each document
alone would (the test: tests/test_documents.py).

Documents are found in the inputs themselves: `data prepare` ends every document with the
eos token, so a token belongs to the document that the next eos ends (the eos included).
Nothing else travels with the batch, and every engine, the held-out split and a mixture
see the same tokens as without masking.

The mask: on CUDA, FlexAttention's block mask (blocks of 128 x 128 positions that cross no
boundary are skipped, so attention costs what the documents need); elsewhere a boolean
[B, 1, T, T] mask for scaled_dot_product_attention (the same numbers; CPUs have no fused
kernel that would skip the masked blocks anyway).
"""

from __future__ import annotations

import functools
from functools import cache
from typing import Any

import numpy as np
import torch

from scaletrain.models.context_parallel import SequenceAttention


def document_layout(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document number of each position [B, T], its position in that document [B, T])."""
    is_eos = tokens == eos_id
    # Exclusive count: the eos closing a document belongs to it, the token after starts the next.
    doc = torch.cumsum(is_eos, dim=1) - is_eos.long()
    t = tokens.shape[1]
    idx = torch.arange(t, device=tokens.device).expand_as(tokens)
    starts = torch.ones_like(is_eos)
    starts[:, 1:] = is_eos[:, :-1]
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return doc, idx - first


def document_mask(doc: torch.Tensor, flex: bool | None = None) -> Any:
    """What the attention takes for documents `doc` [B, T]: a block mask on CUDA (`flex`),
    else a boolean [B, 1, T, T] mask (True: attend)."""
    b, t = doc.shape
    if doc.device.type == "cuda" if flex is None else flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document(batch: Any, head: Any, q: Any, k: Any) -> Any:
            return (doc[batch, q] == doc[batch, k]) & (k <= q)

        return create_block_mask(same_document, b, None, t, t, device=doc.device)
    causal = torch.ones(t, t, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


@functools.lru_cache(maxsize=8)
def window_mask(t: int, window: int, device: torch.device, flex: bool | None = None) -> Any:
    """A Hugging Face sliding window over a whole sequence of `t` positions (key k visible
    to query q when q - window < k <= q, transformers' sliding_window_overlay): a block mask
    on CUDA (`flex`: blocks wholly outside the window are skipped), else a boolean [1, 1, T, T]
    mask. The same for every layer and step of a length: made once."""
    if device.type == "cuda" if flex is None else flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def in_window(batch: Any, head: Any, q: Any, k: Any) -> Any:
            return (k <= q) & (k > q - window)

        return create_block_mask(in_window, None, None, t, t, device=device)
    q, k = torch.arange(t, device=device)[:, None], torch.arange(t, device=device)[None, :]
    return ((k <= q) & (k > q - window))[None, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, gqa: bool, scale: float | None = None) -> torch.Tensor:
    """Attention of q, k, v [B, heads, T, hd]: causal without `mask`, else within documents
    (or a window), or a context-parallel split's (models/context_parallel.py, models/ulysses.py).
    `scale`: the model's own, if not 1/sqrt(hd)."""
    if isinstance(mask, SequenceAttention):
        return mask(q, k, v, gqa)
    if mask is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    if isinstance(mask, torch.Tensor):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    return _flex()(q, k, v, block_mask=mask, enable_gqa=gqa, scale=scale)


@cache
def _flex() -> Any:
    # Compiled once per process: eager FlexAttention is a slow reference implementation.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


MEASURED = 64  # samples whose documents give the FLOPs' attention span


def measured_context(data: Any) -> float:
    """mean_context over the first MEASURED samples of a training stream (a PackedTokens or
    a mixture): their tokens with the context mark off (data/prepare.py's CONTEXT_BIT)."""
    return mean_context(data.batch(range(MEASURED))[:, :-1] & ((1 << 31) - 1), data.eos_id)


def mean_context(windows: np.ndarray, eos_id: int) -> float:
    """The mean, over the windows' positions, of the length of the document piece each
    belongs to inside its window: the attention span FLOPs count per token when documents
    are masked (without masking every token counts the whole window, models/spec.py)."""
    total = 0
    for row in np.asarray(windows):
        ends = np.flatnonzero(row == eos_id) + 1
        cuts = np.concatenate([[0], ends[ends < len(row)], [len(row)]])
        lengths = np.diff(cuts)
        total += int((lengths.astype(np.int64) ** 2).sum())
    return total / max(1, windows.size)
