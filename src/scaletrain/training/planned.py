"""A config planned for a machine as `scaletrain plan` shows it and scaletrain.plan returns
it: the layouts as trained (preflight.py), the goodput under failures (--mtbf-hours) and the
chosen layout as DeepSpeed JSON for Hugging Face Trainer (--emit-deepspeed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from scaletrain.config import Config
from scaletrain.config.eval import DEFAULT_BATCHES
from scaletrain.config.parallel import dims_for
from scaletrain.engines.deepspeed_config import build_deepspeed_config
from scaletrain.errors import UserError
from scaletrain.planning import Setup, planning_spec
from scaletrain.planning.candidate import Plan
from scaletrain.planning.goodput import Failures, GoodputEstimate, estimate_goodput
from scaletrain.planning.hardware import gpu, parse_size, this_cpu
from scaletrain.strategies import FORMATS, TABLE
from scaletrain.training.plan_options import PlanOptions
from scaletrain.training.preflight import plan_as_trained


def build_plan(cfg: Config, opts: PlanOptions | argparse.Namespace) -> tuple[Plan, GoodputEstimate | None, Any]:
    """The plan `scaletrain plan` shows (and scaletrain.plan returns), with its goodput
    estimate where opts asks for one, and the model it planned."""
    device = this_cpu() if (opts.gpu or "").lower() == "cpu" else gpu(opts.gpu, opts.gpu_memory)
    cpu_per_node = parse_size(opts.cpu_memory, "--cpu-memory") if opts.cpu_memory else None
    for name, value in (("--gpus-per-node", opts.gpus_per_node), ("--nodes", opts.nodes)):
        if value < 1:
            raise UserError(f"{name} {value} is invalid; accepted: 1 or more")
    world = opts.gpus_per_node * opts.nodes
    # A strategy the user named is planned as asked (the others beside it); otherwise, as
    # with strategy auto, the planner chooses.
    named = "strategy" in cfg.parallel.model_fields_set and cfg.parallel.strategy != "auto"
    all_strategies = cfg.parallel.strategy == "auto" or not opts.configured_only
    plan, applied, cfg = plan_as_trained(
        cfg, device, world, opts.nodes, cpu_per_node, opts.headroom, all_strategies, named, opts.device_defaults
    )
    model = planning_spec(cfg)
    if applied:
        say = (
            "planned with the device's defaults"
            if opts.device_defaults
            else "train applies on such a GPU (--device-defaults plans with them)"
        )
        plan.notes.append(f"{say}: " + "; ".join(applied))
    if opts.emit_deepspeed:
        path = emit_deepspeed(cfg, plan.chosen.setup, world, Path(opts.emit_deepspeed))
        plan.notes.append(f"DeepSpeed JSON ({plan.chosen.setup.label}) for Hugging Face Trainer written to {path}")
        if plan.chosen.setup.ep > 1:  # ZeRO's JSON has no expert parallel: the layout is written without it
            plan.notes.append(f"that JSON has no expert parallel: parallel.ep={plan.chosen.setup.ep} is scaletrain's fsdp only")
    if cfg.eval.every > 0:
        plan.notes.append(eval_line(cfg, plan))
    goodput = None
    if opts.mtbf_hours is not None:
        goodput = failure_plan(cfg, plan, world, opts)
        plan.notes += goodput_lines(goodput, cfg.checkpoint.every)
    return plan, goodput, model


def eval_line(cfg: Config, plan: Plan) -> str:
    """What evaluation (eval.every) adds to the chosen layout's time: forward only, at the
    clock's forward rate per sequence of the step (its forward phase over the sequences a
    rank runs in it): the eval set's windows and each task pair (eval.tasks) counted as a
    whole window, so an upper bound for tasks, whose pairs are mostly shorter."""
    from scaletrain.data.tasks import load_items

    c = plan.chosen
    s = c.setup
    sequences = s.micro_batch * s.grad_accum  # per rank per step
    forward = (c.time.phases.get("forward", 0.0) if c.time is not None else c.step_time / 3) / sequences
    ranks = max(1, s.dp)
    windows = (cfg.eval.batches or DEFAULT_BATCHES) * s.micro_batch * s.grad_accum * ranks  # unset: at most the default
    # A task file that cannot be read stops the plan in one line, as it would stop the run.
    pairs = sum(len(item.continuations) for task in cfg.eval.tasks for item in load_items(task))
    each = forward * (windows + pairs) / ranks
    between = cfg.eval.every * c.step_time
    tasks = f" + at most {pairs:,} task pairs (eval.tasks), a window each" if pairs else ""
    return (
        f"evaluation: about {each:.3g} s each (forward only: {windows:,} windows{tasks}), every {cfg.eval.every} steps: "
        f"{100 * each / between:.1f}% on top of training"
    )


# A synchronous save (DeepSpeed, or checkpoint.async_save=false) writes every device's state
# to storage while training waits: assumed 1 GB/s per device (a shared filesystem written by
# all devices at once). An async save blocks only for the copy to host memory.
SYNC_SAVE_BYTES_PER_S = 1e9


def failure_plan(cfg: Config, plan: Any, world: int, opts: PlanOptions | argparse.Namespace) -> GoodputEstimate:
    """--mtbf-hours: the goodput of both ways of surviving failures, for the chosen layout."""
    assert opts.mtbf_hours is not None  # build_plan asks for this only with it
    s, m, device = plan.chosen.setup, plan.chosen.memory, plan.device
    groups = opts.ft_groups or max(2, opts.nodes)
    if groups < 2 or world % groups:
        raise UserError(f"--ft-groups {groups} is invalid; accepted: 2 or more replica groups that divide the {world} devices")
    state = m.params + m.grads + m.optimizer  # per device; what a save writes and a rejoining group receives
    sync = not (FORMATS[TABLE[s.strategy].format].background and cfg.checkpoint.async_save)
    save = opts.save_seconds if opts.save_seconds is not None else state / (SYNC_SAVE_BYTES_PER_S if sync else device.host_bw)
    failures = Failures(
        devices=world,
        mtbf_hours=opts.mtbf_hours,
        step_s=plan.chosen.step_time,
        every_steps=cfg.checkpoint.every,
        save_s=save,
        restart_s=opts.restart_minutes * 60.0,
        groups=groups,
        transfer_s=state / device.inter_node_bw,
    )
    return estimate_goodput(failures)


def goodput_lines(g: GoodputEstimate, every: int) -> list[str]:
    at = f"checkpoint.every={every}" if every else "no periodic checkpoint (checkpoint.every=0)"
    return [
        f"failures (--mtbf-hours, the job fails every {g.job_mtbf_h:.3g} h): checkpoint-and-restart at {at}: goodput "
        f"{100 * g.restart:.1f}%; at Young/Daly's optimal interval, checkpoint.every={g.optimal_steps}: "
        f"{100 * g.restart_optimal:.1f}%; replica groups ({g.groups} groups, torchft): {100 * g.replica_groups:.1f}% at "
        f"checkpoint.every={every}, {100 * g.replica_groups_optimal:.1f}% at {g.optimal_steps}",
        f"choose {'replica groups' if g.choice == 'replica_groups' else 'checkpoint-and-restart'}: {g.why} "
        "(docs/fault-tolerance.md; replica groups are not built yet)",
    ]


def emit_deepspeed(cfg: Config, setup: Setup, world: int, path: Path) -> Path:
    """A plan as DeepSpeed JSON in the form HF Trainer accepts: values the Trainer owns
    (batch sizes, optimizer hyper-parameters, clipping, precision switches) are "auto", so
    they come from TrainingArguments and cannot disagree with them. A strategy DeepSpeed
    does not run is written as its DeepSpeed counterpart, the row taking DeepSpeed JSON that
    partitions the same states (fsdp: ZeRO-3); one partitioning nothing (ddp) as stage 0."""
    chosen = TABLE[setup.strategy]
    counterpart = next(s for s in TABLE.values() if s.deepspeed_json and s.partitions == max(1, chosen.partitions))
    par = cfg.parallel.model_copy(
        update=dict(
            strategy=counterpart.name,
            offload_optimizer=setup.offload_optimizer,
            offload_params=setup.offload_params,
            dp_replicate=1,
            deepspeed_extra={},
        )
    )
    ds = build_deepspeed_config(cfg.model_copy(update={"parallel": par}), dims_for(par, world).dp_size)
    if chosen.partitions == 0:
        ds["zero_optimization"]["stage"] = 0
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        if key in ds:
            ds[key] = "auto"
    for section in ("fp16", "bf16"):
        if section in ds:
            ds[section]["enabled"] = "auto"
    if "optimizer" in ds:
        ds["optimizer"]["params"] = {k: "auto" for k in ds["optimizer"].get("params", {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ds, indent=2) + "\n")
    return path
