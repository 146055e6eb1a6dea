"""One optimizer step's time, split as telemetry splits a measured step (telemetry/clock.py):
data, forward, backward, optimizer, and the parts the plan can name besides: exposed
communication, the pipeline's bubble, offload traffic and the loop's own work (other).

forward and backward are the micro-batches' compute (clock/compute.py) with each engine's
own device work folded in (FSDP's copies into and out of its gather buffers and its casts,
DeepSpeed's flattening); `comm` is what of each collective no compute hides
(clock/engines.py). MFU as reported stays the PaLM convention (telemetry/device.py); the
clock prices the operations the kernels run.
"""

from __future__ import annotations

from scaletrain.config import Config
from scaletrain.config.stages import SCHEDULES
from scaletrain.models.spec import ModelSpec
from scaletrain.planning.clock import engines
from scaletrain.planning.clock.compute import float8_traced, micro_batch
from scaletrain.planning.clock.cpu_measured import busy_note
from scaletrain.planning.clock.phases import StepTime
from scaletrain.planning.clock.rates import Rates, rates_for
from scaletrain.planning.hardware import Device
from scaletrain.planning.pipeline import bubble
from scaletrain.planning.setup import Setup

# The loop's own work: per micro-batch, a window read from the token shards and moved to
# the device; per step, the learning rate set and the step's records kept. Telemetry
# measured them at 0.2-0.9 ms (data) and 0.4-3 ms (other) on this project's CPU and the
# H200 (docs/gpu.md "Where the time goes"): these are stated, not priced per operation.
DATA_S = 0.4e-3
OTHER_S = 0.6e-3


def step_time(model: ModelSpec, s: Setup, cfg: Config, device: Device, nodes: int) -> StepTime:
    """The step of layout `s` on `device` (module docstring)."""
    per_node = max(1, s.dp * s.cp * s.tp * s.pp // nodes)
    rates = rates_for(device, per_node)
    compiled = bool(cfg.train.compile)
    mb = micro_batch(model, s, rates, compiled, cfg.train.attention_kernel)
    m = s.grad_accum
    forward, backward = m * mb.forward, m * mb.backward
    work = engines.engine_work(model, s, rates, mb, per_node, nodes)
    forward += work.forward
    backward += work.backward
    if s.float8 and not float8_traced(s):
        # No torchao to trace the float8 block with: the bf16 block's matmuls at the datasheets'
        # float8 peak over bf16's, the casts counted (clock/engines.py), and the plan says so.
        float8 = engines.float8_change(model, s, device, rates, mb, compiled) * m
        backward += float8 * 2 / 3
        forward += float8 / 3
    busy = forward + backward
    phases = {
        "data": m * DATA_S,
        "forward": forward,
        "backward": backward,
        "optimizer": work.optimizer,
        "comm": work.comm,
        "bubble": busy * bubble(s) / (1 - bubble(s)) if s.pp > 1 else 0.0,
        "offload": work.offload,
        "other": OTHER_S + _flush(rates, s, cfg.train.log_every, per_node, nodes),
    }
    largest: dict[str, tuple[tuple[str, float], ...]] = {"forward": mb.largest_forward, "backward": mb.largest_backward}
    for phase, items in work.largest.items():
        largest[phase] = tuple(sorted([*largest.get(phase, ()), *items], key=lambda x: -x[1])[:5])
    if s.pp > 1:
        v = SCHEDULES[s.pp_schedule][1]
        largest["bubble"] = (
            (f"{s.pp - 1} of {v * m + s.pp - 1} slots idle ({s.pp_schedule}, {m} micro-batches)", phases["bubble"]),
        )
    notes = rates.notes + work.notes + busy_note()
    if s.float8 and float8_traced(s) and rates.float8_note():
        notes.append(str(rates.float8_note()))
    elif s.float8 and not float8_traced(s):
        notes.append(
            "train.float8: torchao is not installed, so the float8 block was not traced: its converted matmuls priced at "
            "the datasheets' float8 peak over bf16's, its casts counted by formula (pip install 'scaletrain[float8]')"
        )
    kernel = cfg.train.attention_kernel
    if rates.kind != "cpu" and kernel not in ("auto", "flash") and not rates.has_attention(kernel):
        notes.append(f"train.attention_kernel={kernel}: no rate measured for it on this GPU kind; priced as FlashAttention")
    if cfg.data.document_mask:
        notes.append(
            "data.document_mask: FlexAttention's block-sparse kernel priced as SDPA's causal one over the whole "
            "sequence (no rate measured for FlexAttention; its block mask's making per micro-batch not priced)"
        )
    return StepTime(phases, largest, rates.source, tuple(notes))


def _flush(rates: Rates, s: Setup, log_every: int, per_node: int, nodes: int) -> float:
    """The metrics' flush every train.log_every steps, per step: with several ranks, each
    rank's figures gathered by object (its size, then its pickle: two small all-gathers)."""
    ranks = s.dp * s.cp * s.tp * s.pp
    if ranks == 1:
        return 0.0
    return 2 * rates.collective("all_gather", 4096.0 * ranks, ranks, nodes > 1) / max(1, log_every)


def rates_of(device: Device, s: Setup, nodes: int) -> Rates:
    return rates_for(device, max(1, s.dp * s.cp * s.tp * s.pp // nodes))
