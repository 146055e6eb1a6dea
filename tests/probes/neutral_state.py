"""Probe: engine-neutral state (Engine.state_dict / load_state_dict) across engines.

Run under torchrun. Every engine trains one identical step from the same initialization
and reports its neutral state; then each engine loads the previous engine's state (ddp
into fsdp, fsdp into zero1, ..., zero3 into ddp) and reports what it holds afterwards.
Rank 0 saves {"trained": {engine: state}, "loaded": {engine: (source, state)}} to OUT/states.pt.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from scaletrain.config import load_config
from scaletrain.distributed import init_distributed, shutdown
from scaletrain.engines import build_engine
from scaletrain.models import LlamaSpec, resolve_shape
from scaletrain.optim import decay_groups
from scaletrain.parallel import dims_for

ENGINES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]
MODEL = [
    "model.vocab_size=67",
    "model.dim=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=48",
    "data.seq_len=16",
    "train.micro_batch=2",
    "train.seed=3",
    "run.device=cpu",
    "parallel.deepspeed_extra={zero_optimization: {stage3_param_persistence_threshold: 0}}",
]


def engine_for(strategy: str, world):
    extra = [] if strategy.startswith("zero") else ["parallel.deepspeed_extra={}"]
    cfg = load_config([], [*MODEL, f"parallel.strategy={strategy}", *extra])
    spec = LlamaSpec(resolve_shape(cfg.model))
    return build_engine(spec, world, dims_for(cfg.parallel, world.world_size), cfg, decay_groups(cfg.train.weight_decay)), spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world = init_distributed("cpu", "gloo")
    tokens = torch.randint(0, 67, (2, 17), generator=torch.Generator().manual_seed(world.rank))
    trained, loaded = {}, {}
    for strategy in ENGINES:
        engine, spec = engine_for(strategy, world)
        engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])], spec.loss)
        engine.step(1e-2)
        trained[strategy] = engine.state_dict()
        del engine
        gc.collect()
    for source, strategy in zip(ENGINES, ENGINES[1:] + ENGINES[:1]):
        engine, _ = engine_for(strategy, world)
        engine.load_state_dict(trained[source])
        loaded[strategy] = (source, engine.state_dict())
        del engine
        gc.collect()
    if world.rank == 0:
        torch.save({"trained": trained, "loaded": loaded}, Path(args.out) / "states.pt")
    (Path(args.out) / f"rank{world.rank}.json").write_text(json.dumps({"engines": ENGINES}))
    shutdown(world)


if __name__ == "__main__":
    main()
