"""What train.float8 changes in a plan: time, traffic and memory (docs/float8.md).

The Linear layers float8 converts are models/float8.py's (the engine converts the same).
torchao's tensorwise recipe runs all three matmuls of each (forward, input gradient,
weight gradient) in float8, so:

- time (planning/clock/engines.py float8_change): the converted layers' share of the blocks'
  matmul time runs at the float8 peak's share of the bf16 one; the rest (attention, head,
  router, experts) as in bf16. The casts to float8 are memory-bound kernels, counted as bytes over the device's
  memory bandwidth: each cast of a bf16 tensor reads it twice (its amax, then the cast)
  and writes one byte per element, 5 bytes per element, 9 for an fp32 weight. Per token
  a converted Linear casts its input in forward and again in backward (for the weight
  gradient; a third time when activation checkpointing recomputes the forward) and its
  output gradient twice in backward (one per gradient matmul): 5 x (2 or 3) x in +
  10 x out bytes. Per micro-batch its fp32 weight is cast in forward and in backward
  (ddp), or (fsdp) each shard once per all-gather. Eager-mode counts: torch.compile fuses
  some of these (each cast's amax read into the kernel that made its input: `compiled`).
- FSDP all-gathers the converted weights in float8: 1 byte per weight instead of bf16's 2,
  on the wire and in the gathered units.
- activations: torchao's Float8Linear saves its bf16 input and the weight for backward,
  as a bf16 Linear does (it casts both again in backward), so the traced activations
  stand, except under ddp's autocast, where a bf16 Linear also saves the bf16 copy of
  its fp32 weight and a Float8Linear does not. Its fp32 scales are one scalar per tensor:
  not counted. The float8 copies live only inside one matmul: not counted, like bf16's
  temporaries.

MFU stays against the bf16 peak (telemetry/device.py), as torchtitan reports it: a float8
run's MFU then compares with a bf16 run's, and may exceed what bf16 alone could reach.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from scaletrain.errors import UserError
from scaletrain.models.float8 import cpu_float8_matmul, float8_linears
from scaletrain.models.spec import ModelSpec
from scaletrain.planning.hardware import Device, fmt, is_host
from scaletrain.planning.setup import Setup
from scaletrain.strategies import TABLE

CAST_16 = 5.0  # bytes moved per element cast from bf16 to float8: amax read 2, cast read 2, write 1
CAST_32 = 9.0  # the same from fp32 (the weights' masters): 4 + 4 + 1
CAST_16_COMPILED = 3.0  # compiled: the amax read fused into the producer, a read of 2 and a write of 1
CAST_32_COMPILED = 5.0


@dataclass(frozen=True)
class Converted:
    """The Linear layers float8 converts in a model, by the numbers the plan needs."""

    params: int  # their weights, in the whole model
    in_features: int  # summed over them: the input elements cast per token
    out_features: int  # summed: the output-gradient elements cast per token
    block_params: int  # their weights in the largest block (the unit FSDP gathers, the traced block)

    @property
    def flops_per_token(self) -> float:
        return 6.0 * self.params


@lru_cache(maxsize=64)
def converted(model: ModelSpec) -> Converted:
    meta = model.build_meta(1)
    blocks = model.blocks(meta)
    linears = list(float8_linears(meta, blocks).values())
    # The block with the most parameters, as counts().block takes it (an MoE block, if any).
    largest = max(blocks.children(), key=lambda b: sum(p.numel() for p in b.parameters()))
    in_largest = {id(m) for m in largest.modules()}
    return Converted(
        params=sum(m.weight.numel() for m in linears),
        in_features=sum(m.in_features for m in linears),
        out_features=sum(m.out_features for m in linears),
        block_params=sum(m.weight.numel() for m in linears if id(m) in in_largest),
    )


def plannable(s: Setup) -> bool:
    """Whether a candidate layout can train in float8 (config/float8.py's refusals)."""
    return TABLE[s.strategy].float8 and s.tp == 1 and (s.pp == 1 or TABLE[s.strategy].pp) and s.offload_params == "none"


def check_device(device: Device) -> None:
    if is_host(device) and cpu_float8_matmul():
        return  # this torch runs float8 matmuls on the CPU (models/float8.py)
    if not device.peak_flops_8:
        raise UserError(
            f"train.float8=true needs float8 matmuls; the planned device, {device.name}, has none (NVIDIA compute "
            "capability below 8.9); accepted: such a device (scaletrain plan --gpu h100|h100-pcie|h200|l40s), or train.float8=false"
        )


def cast_bytes(model: ModelSpec, s: Setup, tokens: int, compiled: bool = False) -> float:
    """Bytes the float8 casts move per optimizer step on one rank (module docstring);
    `compiled`: inductor folds each cast's amax read into the kernel that made the tensor,
    leaving its read and its 1-byte write (CAST_16_COMPILED, CAST_32_COMPILED)."""
    c = converted(model)
    c16, c32 = (CAST_16_COMPILED, CAST_32_COMPILED) if compiled else (CAST_16, CAST_32)
    input_casts = 3 if s.activation_checkpointing else 2
    per_token = c16 * (input_casts * c.in_features + 2 * c.out_features)
    if TABLE[s.strategy].partitions == 3 and s.float8_gather:  # FSDP: each shard cast once per all-gather
        gathers = 1 if not s.reshard_after_forward else 2
        weights = c32 * c.params / s.shard * gathers
    else:  # the whole fp32 weight, as often as the input (forward, backward, a recompute)
        weights = c32 * c.params * input_casts
    return tokens * per_token / (s.tp * s.pp * s.cp) + weights * s.grad_accum


def gather_saving(model: ModelSpec, s: Setup, param_bytes: float) -> float:
    """Bytes per weight gather float8 all-gather saves: the converted weights at 1 byte."""
    if not s.float8 or not s.float8_gather or TABLE[s.strategy].partitions < 3:
        return 0.0
    return converted(model).params / s.tp * (param_bytes - 1.0)


def buffer_saving(model: ModelSpec, s: Setup, gathered_bytes: float, all_units: bool) -> float:
    """What FSDP's gathered units hold less with float8 all-gather: the converted weights of
    the units gathered at once (every block when they stay gathered; else the current and
    the prefetched block) at 1 byte instead of `gathered_bytes`."""
    if not s.float8 or not s.float8_gather or TABLE[s.strategy].buffers != "fsdp_units":
        return 0.0
    c = converted(model)
    return (c.params if all_units else 2 * c.block_params) * (gathered_bytes - 1.0)


def saved_saving(model: ModelSpec, s: Setup, regime: str, low_bytes: int) -> float:
    """What one block saves for backward less with float8: under autocast, a bf16 Linear's
    saved 16-bit copy of its fp32 weight, which a Float8Linear does not keep."""
    if not s.float8 or regime != "autocast":
        return 0.0
    return float(converted(model).block_params * low_bytes)


def bf16_beside(chosen: Any, judge: Callable[[Setup], Any], compiled: bool) -> tuple[list[str], dict[str, Any]]:
    """The plan's line comparing the chosen float8 layout with the same layout in bf16, and
    the same figures for its JSON; `compiled`: train.compile (else advice where bf16 is faster)."""
    s = chosen.setup
    if not s.float8:
        return [], {}
    plain = judge(replace(s, float8=False))
    figures = {
        "step_time_s": chosen.step_time,
        "bf16_step_time_s": plain.step_time,
        "speedup": plain.step_time / chosen.step_time if chosen.step_time else None,
        "peak_bytes": chosen.memory.peak,
        "bf16_peak_bytes": plain.memory.peak,
    }
    line = (
        f"train.float8: {s.label} estimated {chosen.step_time:.3g} s/step against {plain.step_time:.3g} in bf16 "
        f"({figures['speedup']:.2f}x; peak {fmt(chosen.memory.peak)} against {fmt(plain.memory.peak)}): "
        f"the blocks' float8 products and their casts priced (docs/float8.md); MFU stays against the bf16 peak"
    )
    lines = [line]
    if not compiled and plain.step_time < chosen.step_time:
        # Eager, each cast is an amax, a scale, a clamp and a copy of its own (torchao's casts
        # unfused), which the float8 products do not win back: torch.compile fuses them.
        lines.append("train.float8 is slower than bf16 here without train.compile: its casts run unfused; add train.compile=true")
    return lines, figures
