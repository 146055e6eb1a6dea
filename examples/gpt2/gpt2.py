"""A GPT-2-style decoder, trained by scaletrain as a model of its own (model.source: python).

Not a Llama: learned absolute positions instead of rotary ones, LayerNorm with biases
instead of RMSNorm, one fused query-key-value projection with biases, a GELU MLP, the head
tied to the token embedding. Nothing in it knows scaletrain but `make_spec`, which tells it
where the blocks are; counts, FLOPs, the planner's trace, init, loss and checkpoints come
from scaletrain's defaults (docs/models.md, "A model of your own").

    scaletrain train examples/gpt2/config.yaml      # with examples/gpt2 on PYTHONPATH
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain import ModuleSpec


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


def make_spec(vocab_size: int, dim: int = 64, layers: int = 2, heads: int = 4, max_len: int = 256):
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
    )


def _matmul_params(vocab_size: int, dim: int, layers: int) -> int:
    per_block = 3 * dim * dim + dim * dim + 2 * 4 * dim * dim
    return layers * per_block + vocab_size * dim  # the tied head multiplies too
