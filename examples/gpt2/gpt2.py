"""A GPT-2-style decoder, trained by scaletrain as a model of its own (model.source: python).

Not a Llama: learned absolute positions instead of rotary ones, LayerNorm with biases
instead of RMSNorm, one fused query-key-value projection with biases, a GELU MLP, the head
tied to the token embedding. Nothing in it knows scaletrain but `make_spec`, which tells it
where the blocks are; counts, FLOPs, the planner's trace, init, loss and checkpoints come
from scaletrain's defaults (docs/models.md, "A model of your own"). With
`tensor_parallel: true` among its arguments the spec also offers a tensor-parallel plan
(`MlpTensorParallel`, below): parallel.tp splits each block's feed-forward.

    scaletrain train examples/gpt2/config.yaml      # with examples/gpt2 on PYTHONPATH
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from scaletrain import ModuleSpec, UserError


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, dim: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, dim)
        self.wpe = nn.Embedding(max_len, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2's

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class MlpTensorParallel:
    """A tensor-parallel plan (scaletrain.TensorParallel's two methods): each block's fc split
    by its output columns and its out by its input rows, so a rank holds 1/tp of the
    feed-forward and one all-reduce after `out` gives every rank the whole residual. The
    attention and the embeddings stay whole on every rank (their gradients are the same on
    each: they see the same tokens). Sequence parallel and a vocabulary-split loss are left
    out: the residual stream and the logits stay whole, which the loss takes as they are."""

    def __init__(self, dim: int):
        self.hidden = 4 * dim

    def check_tp(self, tp: int) -> None:
        if self.hidden % tp:
            raise UserError(f"parallel.tp={tp} does not divide the feed-forward's {self.hidden} columns; accepted: a divisor")

    def apply_tp(self, model: nn.Module, mesh, sequence_parallel: bool, loss_parallel: bool) -> None:
        for block in model.h:
            parallelize_module(block, mesh, {"fc": ColwiseParallel(), "out": RowwiseParallel()})


def make_spec(vocab_size: int, dim: int = 64, layers: int = 2, heads: int = 4, max_len: int = 256, tensor_parallel: bool = False):
    """What `model.spec: gpt2:make_spec` calls, with `model.spec_args` and the tokenizer's vocab_size."""
    # Attention FLOPs beside the matmuls' 6 x parameters: scores and values, 2 x 2 x dim per
    # token and position attended, x3 for backward (as scaletrain counts its own models').
    attention = lambda seq_len: 12 * layers * dim * seq_len  # noqa: E731
    return ModuleSpec(
        lambda: GPT(vocab_size, dim, layers, heads, max_len),
        vocab_size=vocab_size,
        blocks="h",
        flops_per_token=lambda seq_len: 6 * _matmul_params(vocab_size, dim, layers) + attention(seq_len),
        name="gpt2",
        offers=[MlpTensorParallel(dim)] if tensor_parallel else [],
    )


def _matmul_params(vocab_size: int, dim: int, layers: int) -> int:
    per_block = 3 * dim * dim + dim * dim + 2 * 4 * dim * dim
    return layers * per_block + vocab_size * dim  # the tied head multiplies too
