"""`scaletrain ckpt convert`: a checkpoint rewritten in another engine's native format.

One process on the CPU: the target engine is built at world size 1 from the checkpoint's own
config (strategy replaced, offload and hybrid-sharding settings reset: they shape memory, not
state), loads the neutral state (checkpoint/neutral.py), is verified against it tensor by
tensor, and saves a normal checkpoint directory with the trainer state (step, data position,
tokens seen) carried over. Resuming it at another world size reshards as any resume does.
The whole model and its optimizer state are in memory at once (see docs/checkpointing.md).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from scaletrain import checkpoint
from scaletrain.checkpoint.neutral import ParamLayout, read_state
from scaletrain.checkpoint.restore import first_difference
from scaletrain.config import load_config
from scaletrain.config.parallel import dims_for
from scaletrain.engines import build_engine
from scaletrain.errors import UserError
from scaletrain.launch.distributed import ALONE, shutdown
from scaletrain.models import saved_spec
from scaletrain.optim.optimizers import decay_groups


def convert(src: Path, dst: Path, strategy: str, overrides: list[str]) -> str:
    if dst.exists():
        raise UserError(f"{dst} already exists; accepted: a path that does not exist yet (nothing is overwritten)")
    saved = checkpoint.TrainerState.read(src)
    reset = ["parallel.offload_optimizer=none", "parallel.offload_params=none", "parallel.dp_replicate=1", "run.device=cpu"]
    cfg = load_config([str(src / "config.yaml")], [*reset, f"parallel.strategy={strategy}", *overrides])
    world = ALONE
    dims = dims_for(cfg.parallel, 1)
    spec = saved_spec(saved.model)
    layout = ParamLayout(spec.build_meta(cfg.data.seq_len))
    state = read_state(src, layout)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(spec, world, dims, cfg, decay_groups(cfg.train))
    try:
        engine.load_state_dict(state)
        engine.load_extra_state(saved.engine_state)
        problem = first_difference(engine.state_dict(), state)
        if problem:
            raise UserError(
                f"converting {src} to {strategy} did not carry the state over exactly: {problem}; report this as a bug"
            )
        trainer_state = replace(
            saved,
            world_size=1,
            parallel=dims.as_dict(),
            format=engine.format,
            engine=engine.name,
            engine_state=engine.extra_state(),
            converted_from={"path": str(src), "engine": saved.engine, "world_size": saved.world_size},
        )
        files = {"config.yaml": cfg.to_yaml(), **engine.checkpoint_files()}
        checkpoint.save_checkpoint(dst, world, engine.save, trainer_state, files)
    finally:
        del engine
        shutdown(world)  # the single-rank group an engine may have made (fsdp, DeepSpeed)
    return f"converted {src} ({saved.engine}, world {saved.world_size}) to {strategy} at {dst}; verified"
