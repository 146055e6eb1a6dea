"""The planner inside `scaletrain train`: before anything is allocated, predict this run's
memory on the devices it really has, and resolve `parallel.strategy: auto`."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from scaletrain.config import AUTO_MICRO_BATCH, Config
from scaletrain.config.batch import settle, with_micro_batch
from scaletrain.config.parallel import dims_for
from scaletrain.errors import UserError
from scaletrain.launch.distributed import World, rank0_first
from scaletrain.models import ModelSpec
from scaletrain.planning.candidate import Plan
from scaletrain.planning.hardware import KNOWN_GPUS, Device, this_cpu
from scaletrain.planning.planner import fmt, make_plan
from scaletrain.training import defaults


def runtime_device(world: World, local_ranks: int) -> Device:
    """The device this rank trains on, as the planner describes devices."""
    if world.device.type == "cuda":
        props = torch.cuda.get_device_properties(world.device)
        name = props.name.lower()
        known = next((d for key, d in KNOWN_GPUS.items() if key.split("-")[0] in name), KNOWN_GPUS["h100"])
        return replace(known, name=props.name, memory=float(props.total_memory))
    cpu = this_cpu()
    return replace(cpu, memory=cpu.memory / local_ranks)


def runtime_target(world: World) -> defaults.Target:
    """This rank's device, as far as the defaults go (training/defaults.py)."""
    if world.device.type != "cuda":
        return defaults.Target(world.device.type)
    return defaults.Target("cuda", torch.cuda.get_device_name(world.device), torch.cuda.is_bf16_supported())


def plan_run(
    cfg: Config, world: World, model: ModelSpec, free: frozenset[str] = frozenset(), target: defaults.Target | None = None
) -> tuple[Config, list[str]]:
    """(config with the strategy and the micro-batch resolved, the device's defaults for the
    keys in `free` that need a plan applied, the global batch fixed, lines to log). Errors
    only when auto finds nothing."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))
    nodes = max(1, world.world_size // local)
    device = runtime_device(world, local)
    target = target or defaults.Target(world.device.type)
    auto = cfg.parallel.strategy == "auto"
    auto_batch = cfg.train.micro_batch == AUTO_MICRO_BATCH
    # The global batch every layout keeps; replica groups each read 1/groups of it.
    cfg = settle(cfg, dims_for(cfg.parallel, world.world_size).dp_size * cfg.fault_tolerance.groups)
    decide = target.gpu and bool(free & {"train.compile", "parallel.activation_checkpointing"})
    if not (auto or auto_batch or decide or world.is_main):
        # Only rank 0 prints the plan; tracing activations (FakeTensorMode) costs each
        # process ~1 s (it imports torch._dynamo). With auto (or a default that depends on
        # the plan) every rank needs the choice.
        return cfg, []

    def planned(c: Config) -> Plan:
        # The step time only where a choice needs it (the clock costs seconds for a shape
        # it has not priced before): auto's layout, and the defaults that depend on it.
        return make_plan(c, model, world.world_size, nodes, device, all_strategies=auto, as_configured=not auto, timed=decide)

    def resolve() -> tuple[Config, list[str]]:
        return _plan_and_resolve(cfg, planned, target, free, auto, auto_batch, decide, device)

    import torch.distributed as dist

    if not (world.distributed and dist.is_initialized()) or not (auto or decide):
        return resolve()
    # Every rank needs the choice, and on a CPU the plan's step times are measured on the
    # machine (planning/clock/rates.py): rank 0 plans first, measuring and keeping the rates
    # (disk_cache.py), then the others plan with the same numbers; a choice that still
    # differs (the cache off, ranks on several machines measuring their own) is one line.
    first = rank0_first(world, resolve, "planning the layout", 600.0, "see rank 0's output")
    resolved = first if first is not None else resolve()
    _same_everywhere(world, resolved[0])
    return resolved


def _plan_and_resolve(
    cfg: Config,
    planned: Any,
    target: defaults.Target,
    free: frozenset[str],
    auto: bool,
    auto_batch: bool,
    decide: bool,
    device: Device,
) -> tuple[Config, list[str]]:
    try:
        plan = planned(cfg)
    except UserError as e:
        if auto or auto_batch:
            raise
        return cfg, [f"plan: warning: {e}"]
    if decide and not auto:
        cfg, applied = defaults.after_plan(cfg, target, free, lambda c: fits_and_time(planned(c)), accepted)
        if applied:
            plan = planned(cfg)
            return _resolved(cfg, plan, auto, auto_batch, device, [f"defaults: {a}" for a in applied])
    return _resolved(cfg, plan, auto, auto_batch, device, [])


def _same_everywhere(world: World, cfg: Config) -> None:
    """Each rank's resolved layout against rank 0's, through the group's store."""
    import torch.distributed as dist

    p, t = cfg.parallel, cfg.train
    mine = f"{p.strategy} tp={p.tp} pp={p.pp} ep={p.ep} AC={p.activation_checkpointing} mb={t.micro_batch} accum={t.grad_accum} compile={t.compile}"
    store = dist.distributed_c10d._get_default_store()
    key = "scaletrain/plan-choice"
    if world.is_main:
        store.set(key, mine)
        return
    theirs = store.get(key).decode()
    if theirs != mine:
        raise UserError(
            f"rank {world.rank} planned {mine} where rank 0 planned {theirs} (their measured step times differ: another "
            "machine, or SCALETRAIN_CACHE=off); accepted: the layout set in the config (parallel.strategy, train.micro_batch), "
            "or one cache directory every rank reads"
        )


def plan_as_trained(
    cfg: Config,
    device: Device,
    world: int,
    nodes: int,
    cpu_per_node: float | None,
    headroom: float,
    all_strategies: bool,
    named: bool,
    device_defaults: bool,
) -> tuple[Plan, list[str], Config]:
    """`scaletrain plan`'s plan on `world` x `device` (`named`: the configured strategy as the
    plan, the rest beside it), and what train applies on such a device to the keys nobody
    set (training/defaults.py): planned with them under `device_defaults`, else only named.
    The lines saying what was applied, and the config planned."""
    from scaletrain.planning import planning_spec

    def planned(c: Config) -> Plan:
        return make_plan(c, planning_spec(c), world, nodes, device, cpu_per_node, headroom, all_strategies, named)

    model = planning_spec(cfg)
    target = defaults.Target("cpu") if device.kind == "cpu" else defaults.Target("cuda", device.name)
    free = defaults.unset(cfg)
    dp = dims_for(cfg.parallel, world).dp_size
    with_defaults, applied = defaults.before_plan(cfg, target, model.vocab_size, dp, free)
    if device_defaults:
        cfg = with_defaults
        cfg, more = defaults.after_plan(cfg, target, free, lambda c: fits_and_time(planned(c)), accepted)
        applied += more
    return planned(cfg), applied, cfg


def fits_and_time(plan: Plan) -> tuple[bool, float]:
    """Whether the plan's choice fits (at the configured micro-batch or the largest smaller
    one), and its estimated step time."""
    chosen = plan.chosen if plan.chosen.fits or plan.chosen.smaller is None else plan.chosen.smaller
    return chosen.fits, chosen.step_time


def accepted(cfg: Config) -> bool:
    """Whether the config's own rules accept `cfg` (a default is never one it would refuse)."""
    try:
        Config.model_validate(cfg.model_dump())
    except (UserError, ValueError):
        return False
    return True


def _resolved(
    cfg: Config, plan: Plan, auto: bool, auto_batch: bool, device: Device, lines: list[str]
) -> tuple[Config, list[str]]:
    chosen = plan.chosen
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
                ac_mode="selective" if s.selective else "full",
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
