"""Next-token cross entropy, whole or in chunks of tokens.

The plain loss upcasts the logits to fp32 and keeps log-softmax's fp32 output for
backward; backward then makes an fp32 gradient and an fp32 temporary of the same size. For
a large vocabulary that is the biggest allocation of the step (8B-class, micro-batch 16 x
4096 tokens, vocabulary 128k: 34 GB per copy). The chunked loss keeps only the logits as
the head made them (bf16 under mixed precision: no new memory, they exist anyway) and one
fp32 number per token (its log-sum-exp); backward writes the logits' gradient in their own
dtype, chunk by chunk, with fp32 temporaries of one chunk. Same mathematics: softmax
minus the one-hot target, divided by the token count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# A target that is not trained (a fine-tuning prompt, data/finetune.py): no loss, no gradient,
# not counted in the mean. torch's own default, so a Hugging Face loss agrees.
IGNORE_INDEX = -100


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: the built-in model returns them, a Hugging Face one an object holding them."""
    return output if isinstance(output, torch.Tensor) else output.logits


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
    """Mean next-token cross entropy over the trained positions (targets other than
    IGNORE_INDEX; 0 where there is none), in fp32 (bf16 logsumexp over a large vocabulary
    is too coarse); with `chunk_tokens` > 0, `chunk_tokens` positions at a time (see the
    module's text)."""
    flat, labels = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if chunk_tokens <= 0:
        # A sum over the count, not reduction="mean": that is 0/0 for a micro-batch of
        # prompt tokens only, and its NaN would reach the gradients even times a weight of 0.
        return F.cross_entropy(flat.float(), labels, reduction="sum") / trained(labels).clamp(min=1)
    return _ChunkedCrossEntropy.apply(flat, labels, chunk_tokens)


def trained(targets: torch.Tensor) -> torch.Tensor:
    """How many of `targets` are trained (0-d, on their device, no sync)."""
    return (targets != IGNORE_INDEX).sum()


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        n = logits.shape[0]
        valid = targets != IGNORE_INDEX
        targets = torch.where(valid, targets, 0)  # any index gathers; its row is weighted 0
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        picked = torch.empty(n, dtype=torch.float32, device=logits.device)
        for start in range(0, n, chunk):
            part = logits[start : start + chunk].float()
            lse[start : start + chunk] = torch.logsumexp(part, dim=-1)
            picked[start : start + chunk] = part.gather(1, targets[start : start + chunk, None]).squeeze(1)
        weight = valid.float()
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(logits, targets, lse, weight, count)
        ctx.chunk = chunk
        return ((lse - picked) * weight).sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, lse, weight, count = ctx.saved_tensors
        n, chunk = logits.shape[0], ctx.chunk
        out = torch.empty_like(logits)
        scale = grad.float() / count
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            # One fp32 chunk, worked on in place: softmax, minus the one-hot, times the scale
            # (and 0 on the rows that are not trained).
            probs = logits[start:end].to(torch.float32, copy=True)  # a copy even of fp32 logits (saved for backward)
            probs.sub_(lse[start:end, None]).exp_()
            probs[torch.arange(end - start, device=probs.device), targets[start:end]] -= 1.0
            out[start:end] = probs.mul_(scale * weight[start:end, None])  # copy_ casts to the logits' dtype
        return out, None, None
