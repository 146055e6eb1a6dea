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

from scaletrain.launch.distributed import init_distributed, shutdown

from common import SMALL_MODEL, Z3_PARTITION_ALL, build

ENGINES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


def engine_for(strategy: str, world):
    extra = [Z3_PARTITION_ALL] if strategy == "zero3" else []
    engine, spec, _ = build([*SMALL_MODEL, "train.seed=3", f"parallel.strategy={strategy}", *extra], world)
    return engine, spec


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
