"""scaletrain as a library: load a config, plan it, train it, evaluate a checkpoint.

    import scaletrain
    cfg = scaletrain.load_config("my.yaml", {"train.steps": 100})
    print(scaletrain.plan(cfg, gpus_per_node=8).chosen.setup.label)
    summary = scaletrain.train(cfg)                 # every rank: under torchrun, or alone
    print(scaletrain.evaluate(summary.run_dir)["loss"])

Each function returns data (the config, the plan, the run's summary, the eval row) and
prints only what the CLI's command would log while it works (training's progress lines).
A bad value is a scaletrain.UserError with the CLI's one-line message. Under torchrun the
ranks join the launcher's group; a process group the caller made is used as it is and left
alone afterwards. Importing this module imports neither torch nor pydantic: the functions
import what they run when called (docs/api.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scaletrain.config import Config
    from scaletrain.planning.candidate import Plan

Paths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
Overrides = Mapping[str, Any] | Sequence[str]


@dataclass(frozen=True)
class RunSummary:
    """What a finished `train` returns, the same on every rank (but each rank's own clock)."""

    run_dir: Path
    steps: int  # optimizer steps the run has done, earlier starts included
    steps_this_run: int  # of them, those of this call (a resumed run did the others before)
    elapsed_s: float
    loss: float | None  # the last logged training loss (the mean over every rank's tokens)
    eval_loss: float | None  # the last evaluation's loss, where the run evaluated


def load_config(paths: Paths = (), overrides: Overrides = ()) -> Config:
    """YAML files merged in order, then overrides: `["train.lr=3e-4", ...]` (values read as
    on the command line) or `{"train.lr": 3e-4, ...}` (values taken as they are). No files
    and no overrides: the embedded default."""
    from scaletrain.config import load_config as load

    files = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    if isinstance(overrides, Mapping):
        return load(files, values=overrides)
    if isinstance(overrides, str):  # one override given bare: a sequence of its characters otherwise
        overrides = [overrides]
    return load(files, list(overrides))


def train(config: Config | Paths, overrides: Overrides = ()) -> RunSummary:
    """Train as `scaletrain train` does; collective over the launched ranks. `config`: a
    Config, or YAML paths (with `overrides` as load_config takes them)."""
    cfg = _config(config, overrides)
    from scaletrain.engines import preload
    from scaletrain.training.trainer import train as run

    preload(cfg)
    s = run(cfg)
    return RunSummary(Path(s["run_dir"]), s["steps"], s["steps_this_run"], s["elapsed_s"], s.get("loss"), s.get("eval_loss"))


def plan(
    config: Config | Paths,
    overrides: Overrides = (),
    *,
    gpus_per_node: int = 8,
    nodes: int = 1,
    gpu: str | None = None,
    gpu_memory: str | None = None,
    cpu_memory: str | None = None,
    headroom: float = 0.1,
    configured_only: bool = False,
    device_defaults: bool = False,
) -> Plan:
    """The plan `scaletrain plan` shows, as data: every candidate layout with its memory and
    step time, the chosen one and why (`.as_dict()` is the command's --json). The options
    are the command's flags: `gpu` h100 (default), h200, a100, ..., or cpu (this machine)."""
    from scaletrain.cli.plan import check_options
    from scaletrain.cli.plan_output import PlanOptions, build_plan

    opts = PlanOptions(
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        gpu=gpu,
        gpu_memory=gpu_memory,
        cpu_memory=cpu_memory,
        headroom=headroom,
        configured_only=configured_only,
        device_defaults=device_defaults,
    )
    check_options(opts)
    return build_plan(_config(config, overrides), opts)[0]


def evaluate(run_or_checkpoint: str | os.PathLike[str], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The eval loss of a checkpoint (a run directory: its newest complete one), as
    `scaletrain eval` computes it; collective over the launched ranks. Returns its row:
    step, loss, perplexity, tokens, data, engine."""
    from scaletrain.launch.distributed import keep_process_group
    from scaletrain.training.eval_checkpoint import evaluate_checkpoint

    keep_process_group()
    return evaluate_checkpoint(os.fspath(run_or_checkpoint), list(overrides), say=False)


def _config(config: Any, overrides: Overrides) -> Config:
    from scaletrain.config import Config
    from scaletrain.launch.distributed import keep_process_group

    keep_process_group()  # one process group for all of the program's calls (launch/distributed.py)
    if isinstance(config, Config):
        if overrides:
            from scaletrain.errors import UserError

            raise UserError("overrides go with YAML paths, not with a Config: accepted: load_config(paths, overrides)")
        return config
    return load_config(config, overrides)
