"""scaletrain as a library: load a config, plan it, train it, evaluate a checkpoint.

    import scaletrain
    cfg = scaletrain.load_config("my.yaml", {"train.steps": 100})
    print(scaletrain.plan(cfg, gpus_per_node=8).chosen.setup.label)
    summary = scaletrain.train(cfg)                 # every rank: under torchrun, or alone
    print(scaletrain.evaluate(summary.run_dir)["loss"])
    scaletrain.train("gpt.yaml", spec=make_spec)    # a model of your own: model.spec=<its module>:make_spec

Each function returns data (the config, the plan, the run's summary, the eval row) and
prints only what the CLI's command would log while it works (training's progress lines).
A bad value is a scaletrain.UserError with the CLI's one-line message. Under torchrun the
ranks join the launcher's group; a process group the caller made is used as it is and left
alone afterwards. Importing this module imports neither torch nor pydantic: the functions
import what they run when called (docs/api.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scaletrain.config import Config
    from scaletrain.planning.candidate import Plan

Paths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None
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
    from scaletrain.config.load import config_tree, from_tree

    return from_tree(config_tree(*_load_args(paths, overrides)))


PATHS_ACCEPTED = "a YAML path (str or os.PathLike), a list or tuple of them, or () or None for the embedded default"
OVERRIDES_ACCEPTED = 'a dict {"train.lr": 3e-4, ...}, a list of "key=value" strings, or ()'


def _load_args(paths: Paths, overrides: Overrides) -> tuple[list[str], list[str], Mapping[str, Any] | None]:
    """load_config's files, overrides and values; anything else is a UserError naming what
    each takes (a dict given for the paths was read as its keys' paths once)."""
    from scaletrain.errors import UserError

    if paths is None:
        files = []
    elif isinstance(paths, (str, os.PathLike)):
        files = [os.fspath(paths)]
    elif isinstance(paths, (list, tuple)) and all(isinstance(p, (str, os.PathLike)) for p in paths):
        files = [os.fspath(p) for p in paths]
    else:
        hint = " (a dict of values goes in the overrides: load_config((), {...}))" if isinstance(paths, Mapping) else ""
        raise UserError(f"the config's paths are {type(paths).__name__}{hint}; accepted: {PATHS_ACCEPTED}")
    if isinstance(overrides, Mapping) and all(isinstance(k, str) for k in overrides):
        return files, [], overrides
    if isinstance(overrides, str):  # one override given bare: a sequence of its characters otherwise
        overrides = [overrides]
    if not isinstance(overrides, (list, tuple)) or not all(isinstance(o, str) for o in overrides):
        raise UserError(f"the overrides are {type(overrides).__name__}; accepted: {OVERRIDES_ACCEPTED}")
    return files, list(overrides), None


def train(config: Config | Paths, overrides: Overrides = (), *, spec: Callable[..., Any] | None = None) -> RunSummary:
    """Train as `scaletrain train` does; collective over the launched ranks. `config`: a
    Config, or YAML paths (with `overrides` as load_config takes them); anything else, a
    UserError naming those.

    `spec`: a model of your own, the function that returns its scaletrain.ModuleSpec (called
    with model.spec_args and the tokenizer's vocab_size, as a config's model.spec is). The
    same as model.source=python with model.spec naming it by its module and name, which the
    run records (config.yaml, trainer.json) so that a resume, `scaletrain eval` and `ckpt
    convert`/`export` import it again: it must be defined at the top level of a module. One
    defined in the running script (`__main__`) serves that script (its resume, `evaluate`),
    not the CLI (docs/api.md). The config's model.source is builtin (the default: spec= makes
    it python, and model.spec_args may come with it) or python with model.spec unset or
    naming the same function; anything else is refused in one line."""
    cfg = _config(config, overrides, spec)
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
    from scaletrain.training.plan_options import PlanOptions, check_options
    from scaletrain.training.planned import build_plan

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


def _config(config: Any, overrides: Overrides, spec: Callable[..., Any] | None = None) -> Config:
    from scaletrain.config import Config
    from scaletrain.config.load import config_tree, from_tree
    from scaletrain.launch.distributed import keep_process_group

    keep_process_group()  # one process group for all of the program's calls (launch/distributed.py)
    if isinstance(config, Config):
        if overrides:
            from scaletrain.errors import UserError

            raise UserError("overrides go with YAML paths, not with a Config: accepted: load_config(paths, overrides)")
        if spec is None:
            return config
        # The keys it was given, as given: training/defaults.py fills the others on the device.
        tree = config.model_dump(exclude_unset=True)
    else:
        tree = config_tree(*_load_args(config, overrides))
    return from_tree(tree if spec is None else _with_spec(tree, spec))


def _with_spec(tree: dict[str, Any], make: Any) -> dict[str, Any]:
    """The unchecked config `tree` training the model `make` returns: model.source=python,
    model.spec its import string (or the config's own, where that names the same function)."""
    from scaletrain.errors import UserError
    from scaletrain.models.module_spec import import_string, named

    name = import_string(make)
    model = tree.get("model", {})
    if not isinstance(model, dict):  # a bad model section: from_tree says what is wrong
        return tree
    source, given = model.get("source", "builtin"), model.get("spec")
    if source not in ("builtin", "python"):
        raise UserError(
            f"spec={name} is a model of your own, and model.source={source} names another; accepted: spec= with "
            f"model.source=builtin (the default) or python, or model.source={source} without spec="
        )
    if given is not None and given != name and (not isinstance(given, str) or named(given) is not make):
        raise UserError(
            f"model.spec={given} does not name spec={name}; accepted: model.spec naming that function, or no model.spec "
            "(spec= sets it)"
        )
    # A config naming the function by another module that holds it too keeps its own string.
    return {**tree, "model": {**model, "source": "python", "spec": given or name}}
