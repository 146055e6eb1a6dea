"""The dense SwiGLU feed-forward (Shazeer 2020) of the built-in Llama block, and of a
mixture of experts' shared experts (models/moe.py).

train.tile_tokens (`tile`, which sets it on the mixture-of-experts layers (models/moe.py) and the
built-in model's head too): in training, the feed-forward runs over tiles of that many
positions, each tile under its own non-reentrant checkpoint, so that its three hidden
activations (ffn_dim wide, the widest tensors of a block) exist for one tile at a time in
the forward and again, recomputed tile by tile, in the backward (Arctic long-sequence
training's tiled MLP). Each position's output is the same function of its own input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down
        self.tile_tokens = 0  # train.tile_tokens (set by `tile`); 0: whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_tokens and torch.is_grad_enabled() and x.shape[-2] > self.tile_tokens:
            from torch.utils.checkpoint import checkpoint

            tiles = x.split(self.tile_tokens, dim=-2)  # positions: [B, T, dim]
            return torch.cat([checkpoint(self._swiglu, part, use_reentrant=False) for part in tiles], dim=-2)
        return self._swiglu(x)

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def tile(model: nn.Module, tokens: int) -> int:
    """Set train.tile_tokens on every FeedForward of `model`, every mixture-of-experts layer
    (models/moe.py: its experts tile by tile) and the built-in model itself, whose head and
    loss then run tile by tile (models/loss.py HeadTiles); how many dense feed-forwards
    there are."""
    # The built-in model and MoE (models/llama.py, models/moe.py: both import this module) hold the attribute too.
    found = [m for m in model.modules() if isinstance(m, FeedForward) or hasattr(m, "tile_tokens")]
    for module in found:
        setattr(module, "tile_tokens", tokens)  # noqa: B010  # a FeedForward's, or the model's
    return sum(isinstance(m, FeedForward) for m in found)
