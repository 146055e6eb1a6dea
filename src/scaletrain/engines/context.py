"""parallel.cp in an engine (ddp, fsdp, zero1-3): the model, and a teacher beside it, compute this
rank's chunks of each sequence (models/context_parallel.py); the engine's accumulation
window cuts the targets alike (engines/base.py). The gradient reduction needs nothing more:
DDP all-reduces over every rank (dp x cp), FSDP shards over dp_shard x cp (config/parallel.py),
DeepSpeed's data-parallel group is every rank (engines/deepspeed.py)."""

from __future__ import annotations

from typing import Any

from scaletrain.config.parallel import ParallelDims
from scaletrain.engines.offload import ActivationOffload
from scaletrain.launch.distributed import World
from scaletrain.models.capabilities import ContextChunks, capability
from scaletrain.models.context_parallel import ContextParallel
from scaletrain.models.feed_forward import tile
from scaletrain.models.spec import ModelSpec
from scaletrain.models.ulysses import Ulysses


def split_context(
    world: World, dims: ParallelDims, *models: tuple[ModelSpec | None, Any], mode: str = "allgather"
) -> ContextParallel | Ulysses | None:
    """This rank's place in its cp group, of the design `mode` (parallel.cp_mode), given to
    each (spec, model) of `models` (a None pair member: skipped, e.g. no teacher); None without cp."""
    if dims.cp == 1:
        return None
    group, rank = dims.cp_group(world.device), dims.coordinates(world.rank)["cp"]
    cp = Ulysses(group, rank, dims.cp, tp=dims.tp) if mode == "ulysses" else ContextParallel(group, rank, dims.cp)
    for spec, model in models:
        if spec is not None and model is not None:
            capability(spec, ContextChunks, f"parallel.cp={dims.cp}", "parallel.cp=1").apply_cp(model, cp)
    return cp


def long_sequences(
    world: World, dims: ParallelDims, cfg: Any, *models: tuple[ModelSpec | None, Any]
) -> tuple[ContextParallel | Ulysses | None, ActivationOffload | None]:
    """What the accumulating engines (ddp, fsdp, zero1-3) set up for long sequences, on the
    built model and a teacher beside it: the cp split (split_context), the student's
    feed-forwards tiled (train.tile_tokens, models/feed_forward.py), and the offload of
    what its forwards save (train.activation_offload, engines/offload.py)."""
    context = split_context(world, dims, *models, mode=cfg.parallel.cp_mode)
    if cfg.train.tile_tokens:
        tile(models[0][1], cfg.train.tile_tokens)
    return context, ActivationOffload(world.device) if cfg.train.activation_offload else None
