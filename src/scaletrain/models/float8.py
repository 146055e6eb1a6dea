"""Which Linear layers float8 training converts (train.float8; engines/float8.py converts
them with torchao, planning/float8.py counts their FLOPs and bytes). Plain torch, no torchao:
the planner and the tests ask the same question without the extra installed.

The transformer blocks' Linear layers whose both dimensions are multiples of 16 (the
float8 matmul's requirement: torch._scaled_mm refuses others) convert. Never the output
head (the logits feed the loss, and torchtitan keeps it in bf16 for accuracy), the
embedding (a lookup, not a Linear), nor a mixture of experts' router (its few outputs
choose the experts: a float8 rounding there changes which experts run). The experts'
stacked weights (models/moe.py's GroupedExperts) are parameters, not Linear layers: they
stay bf16 (torchao's float8 grouped matmul for them is not wired; docs/float8.md).
"""

from __future__ import annotations

from torch import nn

from scaletrain.models.moe import moe_layers

FLOAT8_MULTIPLE = 16  # both dimensions of a converted Linear's weight


def float8_linears(model: nn.Module, blocks: nn.Module) -> dict[str, nn.Linear]:
    """Name (as in model.named_modules()) -> each Linear float8 training converts, in order.
    `blocks` is the spec's container of transformer blocks (ModelSpec.blocks(model))."""
    routers = {id(moe.router) for moe in moe_layers(blocks)}
    inside = {id(m) for m in blocks.modules()}
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and id(m) in inside and id(m) not in routers and convertible(m.in_features, m.out_features)
    }


def convertible(in_features: int, out_features: int) -> bool:
    return in_features % FLOAT8_MULTIPLE == 0 and out_features % FLOAT8_MULTIPLE == 0
