"""Which Linear layers float8 training converts (train.float8), and the conversion itself with
torchao (`convert_linears`: engines/float8.py for a run, planning/clock/trace.py for the clock's
trace of a block). Which layers is plain torch: the planner and the tests ask it without the
extra installed; torchao is imported only to convert.

The transformer blocks' Linear layers whose both dimensions are multiples of 16 (the
float8 matmul's requirement: torch._scaled_mm refuses others) convert. Never the output
head (the logits feed the loss, and torchtitan keeps it in bf16 for accuracy), the
embedding (a lookup, not a Linear), nor a mixture of experts' router (its few outputs
choose the experts: a float8 rounding there changes which experts run). The experts'
stacked weights (models/moe.py's GroupedExperts) are parameters, not Linear layers: they
stay bf16 (torchao's float8 grouped matmul for them is not wired; docs/float8.md).
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

import torch
from torch import nn

from scaletrain.config.float8 import MISSING_EXTRA
from scaletrain.errors import UserError
from scaletrain.models.moe import moe_layers
from scaletrain.models.torchao_noise import quiet_torchao

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


@cache
def cpu_float8_matmul() -> bool:
    """Whether this torch runs float8 matmuls on the CPU (torch._scaled_mm of two 16 x 16 float8
    matrices; torch 2.13 does, older ones raise)."""
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    one = torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def convert_linears(model: nn.Module, blocks: nn.Module, fsdp_gather: bool) -> list[nn.Module]:
    """Swap the Linear layers `float8_linears` chooses for torchao's Float8Linear, in place
    (tensorwise scaling, torchao's default recipe); `fsdp_gather`: FSDP2 all-gathers their
    weights in float8. The converted modules, in order."""
    ao = torchao_float8()
    chosen = {id(m) for m in float8_linears(model, blocks).values()}
    config = ao.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_gather)
    ao.convert_to_float8_training(model, module_filter_fn=lambda m, _fqn: id(m) in chosen, config=config)
    return [m for m in model.modules() if isinstance(m, ao.Float8Linear)]


def torchao_float8() -> SimpleNamespace:
    """torchao's float8 training API, imported without its import-time noise
    (models/torchao_noise.py); a one-line UserError naming the extra without it."""
    try:
        with quiet_torchao():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
            from torchao.float8.float8_linear import Float8Linear
            from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("torchao"):
            raise
        raise UserError(MISSING_EXTRA) from None
    return SimpleNamespace(
        Float8LinearConfig=Float8LinearConfig,
        convert_to_float8_training=convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp=precompute_float8_dynamic_scale_for_fsdp,
        Float8Linear=Float8Linear,
        WeightWithDynamicFloat8CastTensor=WeightWithDynamicFloat8CastTensor,
    )
