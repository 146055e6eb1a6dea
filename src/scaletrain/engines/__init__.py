"""Engines behind one protocol; `build_engine` picks one from `parallel.strategy`."""

from __future__ import annotations

from scaletrain.config import Config
from scaletrain.distributed import World
from scaletrain.engines.base import Engine, MicroBatch, ParamGroups, StepStats
from scaletrain.models.spec import ModelSpec
from scaletrain.parallel import ParallelDims


def build_engine(
    spec: ModelSpec, world: World, dims: ParallelDims, cfg: Config, param_groups: ParamGroups, teacher: ModelSpec | None = None
) -> Engine:
    """The configured engine around the spec's model; the engine builds and materializes it
    and optimizes what `param_groups` returns. A `teacher` is built beside it, frozen
    (engines/teacher.py), and its output goes to the loss with the model's."""
    strategy = cfg.parallel.strategy
    # Imports stay local: each engine pulls in only its own dependencies (DeepSpeed is heavy).
    if strategy == "ddp":
        from scaletrain.engines.ddp import DDPEngine

        return DDPEngine(spec, world, dims, cfg, param_groups, teacher)
    if strategy == "fsdp":
        from scaletrain.engines.fsdp import FSDPEngine

        return FSDPEngine(spec, world, dims, cfg, param_groups, teacher)
    from scaletrain.engines.deepspeed import DeepSpeedEngine

    return DeepSpeedEngine(spec, world, dims, cfg, param_groups, teacher)


__all__ = ["Engine", "MicroBatch", "ParamGroups", "StepStats", "build_engine"]
