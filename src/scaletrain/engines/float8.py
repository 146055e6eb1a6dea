"""Float8 training of the transformer blocks' Linear layers (train.float8) with torchao's
`convert_to_float8_training`, for the torch engines (ddp, fsdp).

Applied in torchtitan's order: on the meta model, first, before activation checkpointing,
torch.compile and FSDP (each wraps what float8 already swapped in). The recipe is
torchao's default, tensorwise dynamic scaling: one fp32 scale per tensor from its amax,
e4m3 for inputs and weights, e5m2 for gradients, all three matmuls of each Linear in
float8. Which layers convert is models/float8.py's (the planner counts the same ones).

Under FSDP2 the weights are all-gathered in float8 (half the bytes of bf16): torchao's
`enable_fsdp_float8_all_gather`. Its scales are then best computed for every weight at
once after each optimizer step (`Float8.after_step`, one all-reduce); until the engine
calls it, each weight's scale is taken with its own all-reduce inside FSDP's all-gather:
the same numbers, more collectives.

The parameters keep their names, shapes and fp32 values (a converted Linear takes over
the Linear's Parameter), so checkpoints, resharding and exports see the same state with
or without float8. For FSDP's float8 all-gather the weight becomes a torchao tensor
subclass around the fp32 tensor: the state dict gets the plain tensor instead
(`_plain_weights`), so a checkpoint never needs torchao to be read (torch.load's
weights_only, which DCP's reader uses, refuses the subclass: seen before this hook).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from scaletrain.config.float8 import float8_device_problem
from scaletrain.errors import UserError
from scaletrain.models.float8 import convert_linears, cpu_float8_matmul, torchao_float8
from scaletrain.models.spec import ModelSpec


def apply_float8(model: nn.Module, spec: ModelSpec, device: torch.device, fsdp: bool) -> Float8:
    """Refuse a device without float8 matmuls, then convert (`convert`)."""
    hip = device.type == "cuda" and torch.version.hip is not None
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    problem = float8_device_problem(device.type, capability, name, hip, cpu_float8=device.type == "cpu" and cpu_float8_matmul())
    if problem:
        raise UserError(problem)
    return convert(model, spec, fsdp)


def convert(model: nn.Module, spec: ModelSpec, fsdp: bool) -> Float8:
    """Swap the chosen Linear layers of the (meta-device) model for torchao's Float8Linear,
    in place; `fsdp`: their weights all-gathered in float8 by FSDP2 (over NCCL: gloo has no
    float8 dtypes). No device check (the CPU tests convert meta models)."""
    ao = torchao_float8()
    converted = convert_linears(model, spec.blocks(model), fsdp_gather=fsdp)
    if fsdp:
        unwrap = partial(_plain_weights, wrapper=ao.WeightWithDynamicFloat8CastTensor)
        for linear in converted:
            linear.register_state_dict_post_hook(unwrap)
    return Float8(model, ao, precompute=fsdp and bool(converted))


class Float8:
    """What a float8 model needs from its engine after it is built: `after_step()` after
    every optimizer step, and after any load of weights (a resume, a rollback)."""

    def __init__(self, model: nn.Module, ao: Any, precompute: bool):
        self.model, self.ao, self.precompute = model, ao, precompute

    def after_step(self) -> None:
        """FSDP2 with float8 all-gather: every weight's float8 scale from its new values, in
        one all-reduce of the amaxes (torchao's precompute_float8_dynamic_scale_for_fsdp).
        Once called, it must follow every change of the weights: the next all-gathers use
        the scales it left. A skipped step changes nothing; recomputing is still right."""
        if self.precompute:
            self.ao.precompute_float8_dynamic_scale_for_fsdp(self.model)


def _plain_weights(module: nn.Module, state_dict: dict[str, Any], prefix: str, _metadata: Any, wrapper: type) -> None:
    """The state dict of a Float8Linear under FSDP2: the fp32 shard without torchao's wrapper
    (the same storage: a load into it still lands in the parameter)."""
    from torch.distributed.tensor import DTensor

    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, DTensor) and isinstance(value._local_tensor, wrapper):
        local = value._local_tensor._tensor  # type: ignore[attr-defined]  # the fp32 tensor torchao wraps
        state_dict[key] = DTensor.from_local(
            local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
