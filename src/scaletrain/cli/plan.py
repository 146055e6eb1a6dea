"""`scaletrain plan`: the planner's estimate for every strategy and its choice; with
--measure, the configured strategy's prediction against 2 real steps.

CLI glue around the pure planner (scaletrain.planning): the planner never imports this, nor
the engines or the trainer that --measure runs. The table or JSON and --emit-deepspeed are
plan_output.py; --measure is plan_measure.py.
"""

from __future__ import annotations

import argparse

from scaletrain.config import AUTO_MICRO_BATCH, Config, load_config, split_args
from scaletrain.errors import UserError
from scaletrain.launch import startup
from scaletrain.strategies import STRATEGIES
from scaletrain.training.plan_options import check_options


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    pl = sub.add_parser(
        name,
        help="estimate memory, communication and time for every strategy, and pick one",
        description="Estimate per-device memory (params, grads, optimizer, activations, loss, buffers), "
        "communication and step time for every strategy the world allows; choose the fastest that fits.",
    )
    pl.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    pl.add_argument("--gpus-per-node", type=int, default=8)
    pl.add_argument("--nodes", type=int, default=1)
    pl.add_argument("--gpu", help="h100 (default), h100-pcie, h200, a100, a100-40gb, l40s, or cpu (this machine)")
    pl.add_argument("--gpu-memory", help="memory per device, e.g. 80GiB (default: the GPU's)")
    pl.add_argument("--cpu-memory", help="host memory per node, e.g. 1TiB (checks offload)")
    pl.add_argument("--headroom", type=float, default=0.1, help="share of device memory kept free (default 0.1)")
    pl.add_argument("--configured-only", action="store_true", help="only the strategy in the config, not all of them")
    pl.add_argument(
        "--device-defaults",
        action="store_true",
        help="plan with what train applies on such a GPU to the keys you did not set (bf16, auto micro-batch, ...: docs/gpu.md)",
    )
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument("--emit-deepspeed", metavar="PATH", help="write the chosen plan as DeepSpeed JSON for HF Trainer")
    pl.add_argument("--measure", action="store_true", help="run 2 real steps and compare measured with predicted peaks")
    pl.add_argument(
        "--explain-time",
        action="store_true",
        help="the chosen layout's predicted step by phase (data, forward, backward, optimizer, exposed communication, "
        "bubble, offload, other), each with its largest operations",
    )
    pl.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's rates for the planner's clock (a GPU: its table; a CPU: the host's cost per "
        "operation and gloo's collectives), a few tens of seconds",
    )
    pl.add_argument(
        "--longest-sequence",
        action="store_true",
        help="the longest sequence each layout fits (cp designs, tiles, activation offload), with its memory and step time",
    )
    pl.add_argument(
        "--mtbf-hours",
        type=float,
        metavar="H",
        help="mean time between failures per device: estimate the goodput of checkpoint-and-restart and of replica groups",
    )
    pl.add_argument("--restart-minutes", type=float, default=10.0, help="with --mtbf-hours: a restart's cost (default 10)")
    pl.add_argument("--ft-groups", type=int, help="with --mtbf-hours: replica groups (default: one per node, at least 2)")
    pl.add_argument("--save-seconds", type=float, help="with --mtbf-hours: what a save blocks (default: estimated)")
    return pl


def run(args: argparse.Namespace) -> int:
    check_options(args)
    cfg = load_config(*split_args(args.args))
    if args.calibrate:
        with startup.heavy_imports():
            from scaletrain.cli.plan_calibrate import calibrate

        return calibrate(cfg)
    if args.measure:
        check_measurable(cfg)
        with startup.heavy_imports():
            from scaletrain.cli.plan_measure import measure  # the engines, a process group, torch's MemTracker
            from scaletrain.engines import preload

            preload(cfg)
        return measure(cfg, args.json)
    if args.longest_sequence:
        with startup.heavy_imports():
            from scaletrain.cli.plan_longest import show_longest

        return show_longest(cfg, args)
    with startup.heavy_imports():
        from scaletrain.cli.plan_output import show_plan  # the planner (torch: the model is traced on the meta device)

    return show_plan(cfg, args)


def check_measurable(cfg: Config) -> None:
    """What --measure cannot run, said before anything is imported or started."""
    if cfg.parallel.strategy == "auto":
        raise UserError(f"--measure needs a concrete parallel.strategy ({', '.join(STRATEGIES)}), not auto")
    if cfg.train.micro_batch == AUTO_MICRO_BATCH:
        raise UserError("--measure needs a concrete train.micro_batch, not auto (plan without --measure says which fits)")
    if cfg.model.trainable:
        # MemTracker registers a gradient hook on every parameter: a frozen one refuses it.
        raise UserError(
            "--measure does not support model.trainable (torch's MemTracker cannot track frozen parameters); accepted: model.trainable=[]"
        )
    if cfg.parallel.cp > 1 and cfg.parallel.cp_mode != "ulysses":
        # The all-gather design's attention builds a CausalBias (a tensor subclass) for the
        # chunks' offsets, which torch's MemTracker, a dispatch mode, fails to create (torch 2.13).
        raise UserError(
            f"--measure does not support parallel.cp={cfg.parallel.cp} with cp_mode={cfg.parallel.cp_mode} (torch's MemTracker "
            "cannot follow its attention bias); accepted: parallel.cp_mode=ulysses, or parallel.cp=1"
        )
    if cfg.parallel.pp > 1:
        # torch's MemTracker hooks modules through autograd, which a pipeline stage's
        # backward (torch.autograd.grad on its outputs) does not support (torch 2.13).
        raise UserError(
            f"--measure does not support parallel.pp={cfg.parallel.pp} (torch's MemTracker cannot follow a pipeline's backward); accepted: parallel.pp=1"
        )
