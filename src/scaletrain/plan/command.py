"""`scaletrain plan`: print (or emit) the plan; with --measure, check it against real steps."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.plan import make_plan, planning_shape
from scaletrain.plan.hardware import gpu, parse_size, this_cpu
from scaletrain.plan.report import print_measurement, print_plan


def run_plan(cfg: Config, opts: Any) -> int:
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # logs and pipes: never wrap the table
    if opts.measure:
        return _measure(cfg, console, opts.json)
    shape = planning_shape(cfg)
    device = this_cpu() if (opts.gpu or "").lower() == "cpu" else gpu(opts.gpu, opts.gpu_memory)
    cpu_per_node = parse_size(opts.cpu_memory, "--cpu-memory") if opts.cpu_memory else None
    for name, value in (("--gpus-per-node", opts.gpus_per_node), ("--nodes", opts.nodes)):
        if value < 1:
            raise UserError(f"{name} {value} is invalid; accepted: 1 or more")
    world = opts.gpus_per_node * opts.nodes
    auto = cfg.parallel.strategy == "auto" or not opts.configured_only
    plan = make_plan(cfg, shape, world, opts.nodes, device, cpu_per_node, opts.headroom, all_strategies=auto)
    if opts.emit_deepspeed:
        path = emit_deepspeed(cfg, plan.chosen.setup, world, Path(opts.emit_deepspeed))
        plan.notes.append(f"DeepSpeed JSON for Hugging Face Trainer written to {path}")
    if opts.json:
        print(json.dumps(plan.as_dict(), indent=1))
    else:
        print_plan(console, plan, shape, f"plan for model {cfg.model.preset}")
    return 0


def emit_deepspeed(cfg: Config, setup: Any, world: int, path: Path) -> Path:
    """The chosen plan as DeepSpeed JSON in the form HF Trainer accepts: values the Trainer
    owns (batch sizes, optimizer hyper-parameters, clipping, precision switches) are "auto",
    so they come from TrainingArguments and cannot disagree with them."""
    from scaletrain.engines.deepspeed_config import build_deepspeed_config

    strategy = setup.strategy if setup.strategy.startswith("zero") else ("zero3" if setup.strategy == "fsdp" else "zero1")
    par = cfg.parallel.model_copy(update=dict(
        strategy=strategy, offload_optimizer=setup.offload_optimizer, offload_params=setup.offload_params,
        dp_replicate=1, deepspeed_extra={},
    ))
    ds = build_deepspeed_config(cfg.model_copy(update={"parallel": par}), world)
    if setup.strategy == "ddp":
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


def _measure(cfg: Config, console: Console, as_json: bool) -> int:
    """Plan the configured strategy for this process world, then measure it for real."""
    import torch

    from scaletrain.distributed import init_distributed, shutdown
    from scaletrain.plan.measure import measure_peak
    from scaletrain.plan.planner import evaluate, setups_for

    if cfg.parallel.strategy == "auto":
        raise UserError("--measure needs a concrete parallel.strategy (ddp, fsdp, zero1, zero2, zero3), not auto")
    world = init_distributed(cfg.run.device, cfg.parallel.backend)
    try:
        shape = planning_shape(cfg)
        device = this_cpu() if world.device.type == "cpu" else gpu(None, f"{torch.cuda.get_device_properties(world.device).total_memory}B")
        setup = replace(setups_for(cfg, world.world_size, 1, False)[0])
        predicted = evaluate(shape, setup, cfg, device, 1, device.memory, None).memory.as_dict()
        measured = measure_peak(cfg, world, shape)
        if world.is_main:
            if as_json:
                print(json.dumps({"strategy": setup.label, "world": world.world_size, "predicted": predicted, "measured": measured}))
            else:
                console.print(f"[bold]{setup.label}[/] at world {world.world_size} on {world.device.type}", highlight=False)
                print_measurement(console, predicted, measured)
    finally:
        shutdown(world)
    return 0
