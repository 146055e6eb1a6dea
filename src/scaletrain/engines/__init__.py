"""Engines behind one protocol; `build_engine` picks one from `parallel.strategy`."""

from __future__ import annotations

from torch import nn

from scaletrain.config import Config
from scaletrain.distributed import World
from scaletrain.engines.base import Engine, Materialize, StepStats


def build_engine(meta_model: nn.Module, world: World, cfg: Config, materialize: Materialize) -> Engine:
    """Wrap a meta-device model with the configured engine; the engine materializes it."""
    strategy = cfg.parallel.strategy
    # Imports stay local: each engine pulls in only its own dependencies (DeepSpeed is heavy).
    if strategy == "ddp":
        from scaletrain.engines.ddp import DDPEngine

        return DDPEngine(meta_model, world, cfg, materialize)
    if strategy == "fsdp":
        from scaletrain.engines.fsdp import FSDPEngine

        return FSDPEngine(meta_model, world, cfg, materialize)
    from scaletrain.engines.deepspeed import DeepSpeedEngine

    return DeepSpeedEngine(meta_model, world, cfg, materialize)


__all__ = ["Engine", "Materialize", "StepStats", "build_engine"]
