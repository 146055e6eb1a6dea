"""Engines behind one protocol; `build_engine` picks one from `parallel.strategy`.

Each engine module (`scaletrain.engines.<row.engine>`, the strategy table's) exports
`ENGINE`, its class; it is imported only when chosen: each pulls in only its own
dependencies (DeepSpeed is heavy)."""

from __future__ import annotations

import importlib

from scaletrain.config import Config
from scaletrain.distributed import World
from scaletrain.engines.base import Engine, MicroBatch, ParamGroups, StepStats
from scaletrain.models.spec import ModelSpec
from scaletrain.parallel import ParallelDims
from scaletrain.strategies import strategy


def build_engine(
    spec: ModelSpec, world: World, dims: ParallelDims, cfg: Config, param_groups: ParamGroups, teacher: ModelSpec | None = None
) -> Engine:
    """The configured engine around the spec's model; the engine builds and materializes it
    and optimizes what `param_groups` returns. A `teacher` is built beside it, frozen
    (engines/teacher.py), and its output goes to the loss with the model's."""
    module = importlib.import_module(f"scaletrain.engines.{strategy(cfg.parallel.strategy).engine}")
    engine: Engine = module.ENGINE(spec, world, dims, cfg, param_groups, teacher)
    return engine


__all__ = ["Engine", "MicroBatch", "ParamGroups", "StepStats", "build_engine"]
