"""`scaletrain plan`: print (or emit) the plan; with --measure, check it against real steps.

CLI glue around the pure planner (scaletrain.plan): the planner never imports this, nor
the engines or the trainer that --measure runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.models import ModelSpec
from scaletrain.parallel import dims_for
from scaletrain.plan import Setup, make_plan, planning_spec
from scaletrain.plan.hardware import gpu, parse_size, this_cpu
from scaletrain.plan.report import print_measurement, print_plan

# MemTracker's categories, folded into the planner's components.
_COMPONENTS = {
    "PARAM": "params",
    "GRAD": "grads",
    "OPT": "optimizer",
    "ACT": "activations+loss",
    "TEMP": "activations+loss",
    "BUFFER": "buffers",
    "OTH": "buffers",
}


def run_plan(cfg: Config, opts: Any) -> int:
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # logs and pipes: never wrap the table
    if opts.measure:
        return _measure(cfg, console, opts.json)
    model = planning_spec(cfg)
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
    plan = make_plan(cfg, model, world, opts.nodes, device, cpu_per_node, opts.headroom, all_strategies, as_configured=named)
    if opts.emit_deepspeed:
        path = emit_deepspeed(cfg, plan.chosen.setup, world, Path(opts.emit_deepspeed))
        plan.notes.append(f"DeepSpeed JSON ({plan.chosen.setup.label}) for Hugging Face Trainer written to {path}")
    if opts.json:
        print(json.dumps(plan.as_dict(), indent=1))
    else:
        print_plan(console, plan, model, f"plan for model {cfg.model.preset}")
    return 0


def emit_deepspeed(cfg: Config, setup: Setup, world: int, path: Path) -> Path:
    """A plan as DeepSpeed JSON in the form HF Trainer accepts: values the Trainer owns
    (batch sizes, optimizer hyper-parameters, clipping, precision switches) are "auto", so
    they come from TrainingArguments and cannot disagree with them. fsdp is written as its
    DeepSpeed counterpart ZeRO-3, ddp as stage 0."""
    from scaletrain.engines.deepspeed_config import build_deepspeed_config

    strategy = setup.strategy if setup.strategy.startswith("zero") else ("zero3" if setup.strategy == "fsdp" else "zero1")
    par = cfg.parallel.model_copy(
        update=dict(
            strategy=strategy,
            offload_optimizer=setup.offload_optimizer,
            offload_params=setup.offload_params,
            dp_replicate=1,
            deepspeed_extra={},
        )
    )
    ds = build_deepspeed_config(cfg.model_copy(update={"parallel": par}), dims_for(par, world).dp_size)
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
    from scaletrain.distributed import init_distributed, shutdown
    from scaletrain.plan.planner import evaluate, setups_for

    if cfg.parallel.strategy == "auto":
        raise UserError("--measure needs a concrete parallel.strategy (ddp, fsdp, zero1, zero2, zero3), not auto")
    if cfg.model.trainable:
        # MemTracker registers a gradient hook on every parameter: a frozen one refuses it.
        raise UserError(
            "--measure does not support model.trainable (torch's MemTracker cannot track frozen parameters); accepted: model.trainable=[]"
        )
    if cfg.parallel.pp > 1:
        # torch's MemTracker hooks modules through autograd, which a pipeline stage's
        # backward (torch.autograd.grad on its outputs) does not support (torch 2.13).
        raise UserError(
            f"--measure does not support parallel.pp={cfg.parallel.pp} (torch's MemTracker cannot follow a pipeline's backward); accepted: parallel.pp=1"
        )
    world = init_distributed(cfg.run.device, cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        model = planning_spec(cfg)
        device = (
            this_cpu()
            if world.device.type == "cpu"
            else gpu(None, f"{torch.cuda.get_device_properties(world.device).total_memory}B")
        )
        setup = setups_for(cfg, world.world_size, 1, False)[0]
        predicted = evaluate(model, setup, cfg, device, 1, device.memory, None).memory.as_dict()
        measured = measure_peak(cfg, world, model)
        if world.is_main:
            if as_json:
                print(
                    json.dumps({"strategy": setup.label, "world": world.world_size, "predicted": predicted, "measured": measured})
                )
            else:
                console.print(f"[bold]{setup.label}[/] at world {world.world_size} on {world.device.type}", highlight=False)
                print_measurement(console, predicted, measured)
    finally:
        import gc

        gc.collect()
        shutdown(world)
    return 0


def measure_peak(cfg: Config, world: Any, model: ModelSpec, steps: int = 3) -> dict[str, float]:
    """Bytes at this rank's peak, by component, plus 'peak' (and 'cuda_max_allocated' on GPU).

    Every allocation from before the model is built to the end of the last step is tracked
    by torch's MemTracker (a dispatch-mode tensor tracker that also sorts tensors into
    params, grads, optimizer state, activations and temporaries), so buffers DeepSpeed or
    FSDP allocate at set-up count too. Tokens are random: memory does not depend on them.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    from scaletrain.engines import build_engine
    from scaletrain.optim import decay_groups, lr_at

    if world.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(world.device)
    tracker = MemTracker()
    generator = torch.Generator().manual_seed(cfg.train.seed)
    dims = dims_for(cfg.parallel, world.world_size)
    with tracker:
        engine = build_engine(model, world, dims, cfg, decay_groups(cfg.train.weight_decay))
        for step in range(steps):
            tracker.reset_mod_stats()  # MemTracker tracks one iteration's module stats at a time
            batches = [_random_batch(cfg, model, generator) for _ in range(cfg.train.grad_accum)]
            engine.forward_backward(batches, model.loss)  # the trainer's own unit of work
            engine.step(lr_at(step, cfg.train))
        del engine
    snapshot = tracker.get_tracker_snapshot("peak")
    out: dict[str, float] = {}
    for device, by_kind in snapshot.items():
        if torch.device(device).type != world.device.type:
            continue
        for kind, nbytes in by_kind.items():
            name = str(kind).split(".")[-1]
            if name == "Total":
                out["peak"] = float(nbytes)
            else:
                key = _COMPONENTS.get(name, "buffers")
                out[key] = out.get(key, 0.0) + float(nbytes)
    if world.device.type == "cuda":
        out["cuda_max_allocated"] = float(torch.cuda.max_memory_allocated(world.device))
    return out


def _random_batch(cfg: Config, model: ModelSpec, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, model.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
