"""Engines behind one protocol; `build_engine` picks one from `parallel.strategy`."""

from __future__ import annotations

from torch import nn

from scaletrain.config import Config
from scaletrain.distributed import World
from scaletrain.engines.base import Engine, StepStats


def build_engine(model: nn.Module, world: World, cfg: Config) -> Engine:
    if cfg.parallel.strategy == "ddp":
        from scaletrain.engines.ddp import DDPEngine

        return DDPEngine(model, world, cfg)
    raise AssertionError(f"unhandled strategy {cfg.parallel.strategy}")  # the schema forbids others


__all__ = ["Engine", "StepStats", "build_engine"]
