"""The planner inside `scaletrain train`: before anything is allocated, predict this run's
memory on the devices it really has, and resolve `parallel.strategy: auto`."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from scaletrain.batch import settle, with_micro_batch
from scaletrain.config import AUTO_MICRO_BATCH, Config
from scaletrain.distributed import World
from scaletrain.errors import UserError
from scaletrain.models import ModelSpec
from scaletrain.parallel import dims_for
from scaletrain.plan.hardware import KNOWN_GPUS, Device, this_cpu
from scaletrain.plan.planner import fmt, make_plan


def runtime_device(world: World, local_ranks: int) -> Device:
    """The device this rank trains on, as the planner describes devices."""
    if world.device.type == "cuda":
        props = torch.cuda.get_device_properties(world.device)
        name = props.name.lower()
        known = next((d for key, d in KNOWN_GPUS.items() if key.split("-")[0] in name), KNOWN_GPUS["h100"])
        return replace(known, name=props.name, memory=float(props.total_memory))
    cpu = this_cpu()
    return replace(cpu, memory=cpu.memory / local_ranks)


def plan_run(cfg: Config, world: World, model: ModelSpec) -> tuple[Config, list[str]]:
    """(config with the strategy and the micro-batch resolved, the global batch fixed, lines
    to log). Errors only when auto finds nothing."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))
    nodes = max(1, world.world_size // local)
    device = runtime_device(world, local)
    auto = cfg.parallel.strategy == "auto"
    auto_batch = cfg.train.micro_batch == AUTO_MICRO_BATCH
    # The global batch every layout keeps; replica groups each read 1/groups of it.
    cfg = settle(cfg, dims_for(cfg.parallel, world.world_size).dp_size * cfg.fault_tolerance.groups)
    if not (auto or auto_batch or world.is_main):
        # Only rank 0 prints the plan; tracing activations (FakeTensorMode) costs each
        # process ~1 s (it imports torch._dynamo). With auto every rank needs the choice.
        return cfg, []
    try:
        plan = make_plan(cfg, model, world.world_size, nodes, device, all_strategies=auto, as_configured=not auto)
    except UserError as e:
        if auto or auto_batch:
            raise
        return cfg, [f"plan: warning: {e}"]
    chosen, lines = plan.chosen, []
    s = chosen.setup
    if auto:
        parallel = cfg.parallel.model_copy(
            update=dict(
                strategy=s.strategy,
                tp=s.tp,
                sequence_parallel=s.sequence_parallel,
                pp=s.pp,
                pp_schedule=s.pp_schedule,
                ep=s.ep,
                offload_optimizer=s.offload_optimizer,
                offload_params=s.offload_params,
                reshard_after_forward=s.reshard_after_forward,
                dp_replicate=s.dp_replicate,
                activation_checkpointing=s.activation_checkpointing,
                auto_choice="; ".join(plan.reasons),
            )
        )
        cfg = cfg.model_copy(update={"parallel": parallel})
        lines.append(f"plan: parallel.strategy=auto -> {s.label}: " + "; ".join(plan.reasons))
    elif not chosen.fits:
        lines.append("plan: warning: " + "; ".join(plan.reasons))
    if auto or (auto_batch and chosen.fits):
        # The layout's own micro-batch at the global batch: a tp / pp layout's fewer
        # data-parallel ranks accumulate more; a searched micro-batch, smaller ones more often.
        cfg = with_micro_batch(cfg, s.dp, s.micro_batch, plan.batch_choice or cfg.train.batch_choice)
        if plan.batch_choice and not auto:
            lines.append(f"plan: {plan.batch_choice}")
    elif auto_batch:
        raise UserError(f"train.micro_batch=auto: {'; '.join(plan.reasons)}")
    m = chosen.memory
    lines.append(
        f"plan: predicted peak {fmt(m.peak)} per device at {m.peak_phase} (of {fmt(device.memory)}): "
        f"params {fmt(m.params)}, grads {fmt(m.grads)}, optimizer {fmt(m.optimizer)}, "
        f"activations {fmt(m.activations)}, loss {fmt(m.loss)}, buffers {fmt(m.buffers)}"
        + (f", host {fmt(m.cpu)}" if m.cpu else "")
    )
    return cfg, lines
