"""`plan --measure`: run a few real steps of the configured engine and record the peak.

Every allocation from before the model is built to the end of the last step is tracked by
torch's MemTracker (a dispatch-mode tensor tracker that also sorts tensors into params,
grads, optimizer state, activations and temporaries), so engine buffers DeepSpeed or FSDP
allocate at set-up are counted too. On CUDA, torch.cuda.max_memory_allocated is reported
beside it. Tokens are random: memory does not depend on their values.
"""

from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from scaletrain.config import Config
from scaletrain.distributed import World
from scaletrain.engines import build_engine
from scaletrain.models import build_meta_model, materialize
from scaletrain.models.presets import ModelShape
from scaletrain.optim import lr_at

# MemTracker's categories, folded into the planner's components.
_COMPONENTS = {"PARAM": "params", "GRAD": "grads", "OPT": "optimizer", "ACT": "activations+loss", "TEMP": "activations+loss", "BUFFER": "buffers", "OTH": "buffers"}


def measure_peak(cfg: Config, world: World, shape: ModelShape, steps: int = 3) -> dict[str, float]:
    """Bytes at this rank's peak, by component, plus 'peak' (and 'cuda_max_allocated' on GPU)."""
    from scaletrain.trainer import train_step  # the trainer's own step, not a copy of it

    if world.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(world.device)
    tracker = MemTracker()
    generator = torch.Generator().manual_seed(cfg.train.seed)
    with tracker:
        model = build_meta_model(shape, cfg.data.seq_len)
        engine = build_engine(model, world, cfg, lambda m, device: materialize(m, device, cfg.train.seed))
        for step in range(steps):
            tracker.reset_mod_stats()  # MemTracker tracks one iteration's module stats at a time
            batches = [_random_batch(cfg, shape, generator) for _ in range(cfg.train.grad_accum)]
            train_step(engine, batches, world.device)
            engine.step(lr_at(step, cfg.train))
    snapshot = tracker.get_tracker_snapshot("peak")
    out: dict[str, float] = {}
    for device, by_kind in snapshot.items():
        if torch.device(device).type != world.device.type:
            continue
        for kind, nbytes in by_kind.items():
            name = str(kind).split(".")[-1]
            if name == "Total":
                out["peak"] = float(nbytes)
            else:
                key = _COMPONENTS.get(name, "buffers")
                out[key] = out.get(key, 0.0) + float(nbytes)
    if world.device.type == "cuda":
        out["cuda_max_allocated"] = float(torch.cuda.max_memory_allocated(world.device))
    return out


def _random_batch(cfg: Config, shape: ModelShape, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, shape.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
