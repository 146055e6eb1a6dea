"""Engines behind one protocol; `build_engine` picks one from `parallel.strategy`.

Each engine module (`scaletrain.engines.<row.engine>`, the strategy table's) exports
`ENGINE`, its class; it is imported only when chosen: each pulls in only its own
dependencies (DeepSpeed is heavy)."""

from __future__ import annotations

import importlib
from types import ModuleType

from scaletrain.config import Config
from scaletrain.config.parallel import ParallelDims
from scaletrain.engines.base import Engine, MicroBatch, ParamGroups, StepStats
from scaletrain.launch.distributed import World
from scaletrain.launch.env import use_build_environment
from scaletrain.models.spec import ModelSpec
from scaletrain.strategies import TABLE, strategy


def build_engine(
    spec: ModelSpec, world: World, dims: ParallelDims, cfg: Config, param_groups: ParamGroups, teacher: ModelSpec | None = None
) -> Engine:
    """The configured engine around the spec's model; the engine builds and materializes it
    and optimizes what `param_groups` returns. A `teacher` is built beside it, frozen
    (engines/teacher.py), and its output goes to the loss with the model's."""
    engine: Engine = _module(cfg).ENGINE(spec, world, dims, cfg, param_groups, teacher)
    return engine


def preload(cfg: Config) -> None:
    """What building the configured model and engine will import, imported now: the CLI does
    it while the collector is paused (launch/startup.py). torch._dynamo is imported by every
    torch.optim constructor (DeepSpeed's optimizers included); transformers' auto classes
    by a Hugging Face model or teacher; an engine module may name more with a
    `preload(cfg)` of its own (DeepSpeed's)."""
    import torch._dynamo  # noqa: F401

    if "hf" in (cfg.model.source, cfg.model.teacher and cfg.model.teacher.source):
        from scaletrain.models.hf import transformers_module

        transformers_module().AutoModelForCausalLM  # noqa: B018  # its lazy module's import
    if cfg.parallel.strategy not in TABLE:  # auto: the trainer's planner picks the engine later
        return
    hook = getattr(_module(cfg), "preload", None)
    if hook is not None:
        hook(cfg)


def _module(cfg: Config) -> ModuleType:
    use_build_environment()  # before DeepSpeed (or an engine that imports it) may build an op
    return importlib.import_module(f"scaletrain.engines.{strategy(cfg.parallel.strategy).engine}")


__all__ = ["Engine", "MicroBatch", "ParamGroups", "StepStats", "build_engine", "preload"]
