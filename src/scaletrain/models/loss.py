"""Next-token cross entropy, whole or in chunks of tokens.

The plain loss upcasts the logits to fp32 and keeps log-softmax's fp32 output for
backward; backward then makes an fp32 gradient and an fp32 temporary of the same size. For
a large vocabulary that is the biggest allocation of the step (8B-class, micro-batch 16 x
4096 tokens, vocabulary 128k: 34 GB per copy). The chunked loss keeps only the logits as
the head made them (bf16 under mixed precision: no new memory, they exist anyway) and one
fp32 number per token (its log-sum-exp); backward writes the logits' gradient in their own
dtype, chunk by chunk, with fp32 temporaries of one chunk. Same mathematics: softmax
minus the one-hot target, divided by the token count.

Compiled (`compiled=True`: the spec's `loss_compiled`, set with train.compile). Eager, each
chunk's work is a string of whole-chunk kernels, each reading and writing it in fp32: the
upcast, log-sum-exp and the target's gather forward; the upcast, minus the log-sum-exp,
exp, the one-hot, the scale and the cast back in backward. That is ~14 bytes moved per logit
forward and ~36 backward against the 2 + 4 of reading the bf16 logits and writing their bf16
gradient once: for the 1b preset at micro-batch 16 x 2048 (4.2e9 logits a step, a 128,256
vocabulary) ~185 GB more than that, ~40 ms at an H200's 4.8 TB/s, 7% of its compiled step (docs/gpu.md).
torch.compile makes each full chunk's forward and backward one fused kernel (a reduction and
a pointwise map over the chunk); a last, shorter chunk runs eagerly, so that one shape is
compiled whatever the micro-batch, the evaluation's batch or a short last accumulation
(dynamic=False: a new shape would be a new compile). The same formula: its fp32 rounding may
differ in the last bits (the reduction's order, the exponential's implementation), row by row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from scaletrain.models.inductor import portable_cpu_code

# A target that is not trained (a fine-tuning prompt, data/finetune.py): no loss, no gradient,
# not counted in the mean. torch's own default, so a Hugging Face loss agrees.
IGNORE_INDEX = -100


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: the built-in model returns them, a Hugging Face one an object holding them."""
    if isinstance(output, HeadTiles):
        return output.head(output.hidden)  # whole: what only a caller that needs them all asks for
    return output if isinstance(output, torch.Tensor) else output.logits


@dataclass(frozen=True)
class HeadTiles:
    """train.tile_tokens on the built-in model: the last block's output and the head (final
    norm and output projection) instead of the logits; the loss runs the head and the cross
    entropy `tokens` positions at a time, each tile under its own checkpoint, so that no more
    than one tile's logits (and their fp32 gradient) exist, in the forward or, recomputed,
    in the backward (Arctic long-sequence training's tiled logits and loss)."""

    hidden: torch.Tensor  # [B, T, dim]
    head: Callable[[torch.Tensor], torch.Tensor]
    tokens: int


def tiled_cross_entropy(out: HeadTiles, targets: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
    """cross_entropy's mean over the trained positions, the head run tile by tile: tiles of
    train.loss_chunk_tokens where that is fewer (a large vocabulary's logits for a whole
    feed-forward tile, with their fp32 work, would be the step's largest tensors)."""
    return _TILES(out, targets, min(out.tokens, chunk_tokens) if chunk_tokens > 0 else out.tokens)


class _TiledLoss(nn.Module):
    """The tiles' loop as a module of its own (no parameters, in no model): module-tracking
    tools (torch's MemTracker, `plan --measure`) then see the head's repeated calls inside
    a parent, as they see a block's feed-forward tiles."""

    def forward(self, out: HeadTiles, targets: torch.Tensor, tokens: int) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        hidden, labels = out.hidden.reshape(-1, out.hidden.shape[-1]), targets.reshape(-1)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, labels.shape[0], tokens):
            end = start + tokens
            total = total + checkpoint(_tile_loss, out.head, hidden[start:end], labels[start:end], use_reentrant=False)
        return total / trained(labels).clamp(min=1)


_TILES = _TiledLoss()


def _tile_loss(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, reduction="sum")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 0, compiled: bool = False) -> torch.Tensor:
    """Mean next-token cross entropy over the trained positions (targets other than
    IGNORE_INDEX; 0 where there is none), in fp32 (bf16 logsumexp over a large vocabulary
    is too coarse); with `chunk_tokens` > 0, `chunk_tokens` positions at a time, each
    chunk's work one compiled kernel where `compiled` (see the module's text)."""
    flat, labels = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if chunk_tokens <= 0:
        # A sum over the count, not reduction="mean": that is 0/0 for a micro-batch of
        # prompt tokens only, and its NaN would reach the gradients even times a weight of 0.
        return F.cross_entropy(flat.float(), labels, reduction="sum") / trained(labels).clamp(min=1)
    return _ChunkedCrossEntropy.apply(flat, labels, chunk_tokens, compiled)


def trained(targets: torch.Tensor) -> torch.Tensor:
    """How many of `targets` are trained (0-d, on their device, no sync)."""
    return (targets != IGNORE_INDEX).sum()


def _chunk_forward(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's log-sum-exp and target logit, in fp32."""
    x = logits.float()
    return torch.logsumexp(x, dim=-1), x.gather(1, targets[:, None]).squeeze(1)


def _chunk_backward(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """One chunk's gradient in the logits' dtype: (softmax - one-hot) x coef, coef the scale
    per row (0 on the rows that are not trained). Written for inductor, which fuses it into
    one kernel: eagerly each step would be a chunk-sized temporary (_chunk_backward_in_place)."""
    probs = (logits.float() - lse[:, None]).exp()
    hit = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    return (torch.where(hit, probs - 1.0, probs) * coef[:, None]).to(logits.dtype)


def _chunk_backward_in_place(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """The same, eagerly, on one fp32 copy of the chunk worked on in place: the one chunk
    temporary the planner counts (a version with a temporary per step measured 2 GiB over
    its prediction on an H100, docs/planner.md). The same operations in the same order."""
    probs = logits.to(torch.float32, copy=True)  # a copy even of fp32 logits (saved for backward)
    probs.sub_(lse[:, None]).exp_()
    probs[torch.arange(logits.shape[0], device=probs.device), targets] -= 1.0
    return probs.mul_(coef[:, None])  # the caller's copy into the gradient casts to the logits' dtype


_compiled: dict[str, Any] = {}


def _kernels(compiled: bool, logits: torch.Tensor, chunk: int) -> tuple[Any, Any]:
    """The chunk functions for a chunk of `logits`: compiled once per process for full chunks
    where `compiled`, else eager (see the module's text). Eager on fake tensors: the planner
    traces the loss under FakeTensorMode (planning/activations.py), where compiling crashed
    the process (a segmentation fault in dynamo, torch 2.13, CPU)."""
    if not compiled or logits.shape[0] != chunk or is_fake(logits):
        return _chunk_forward, _chunk_backward_in_place
    if not _compiled:
        portable_cpu_code()
        _compiled.update(
            forward=torch.compile(_chunk_forward, dynamic=False, fullgraph=True),
            backward=torch.compile(_chunk_backward, dynamic=False, fullgraph=True),
        )
    return _compiled["forward"], _compiled["backward"]


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, chunk: int, compiled: bool) -> torch.Tensor:
        n = logits.shape[0]
        valid = targets != IGNORE_INDEX
        targets = torch.where(valid, targets, 0)  # any index gathers; its row is weighted 0
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        picked = torch.empty(n, dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            forward, _ = _kernels(compiled, logits[start:end], chunk)
            lse[start:end], picked[start:end] = forward(logits[start:end], targets[start:end])
        weight = valid.float()
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(logits, targets, lse, weight, count)
        ctx.chunk, ctx.compiled = chunk, compiled
        return ((lse - picked) * weight).sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, targets, lse, weight, count = ctx.saved_tensors
        n, chunk = logits.shape[0], ctx.chunk
        out = torch.empty_like(logits)
        coef = weight * (grad.float() / count)  # per row: the mean's scale, 0 where not trained
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            _, backward = _kernels(ctx.compiled, logits[start:end], chunk)
            out[start:end] = backward(logits[start:end], lse[start:end], targets[start:end], coef[start:end])
        return out, None, None, None
