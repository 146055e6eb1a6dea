"""Probe: a frozen base on every engine. Run under torchrun.

For each strategy: build the engine exactly as `train` does with model.trainable set, take
the full weights, run 2 optimizer steps on random tokens, take them again and the
engine-neutral optimizer state. Rank 0 writes OUT/frozen.json: per strategy, the frozen
and trainable parameter names that changed and the parameters with optimizer state.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from scaletrain.distributed import init_distributed, shutdown
from scaletrain.engines.checkpointing import plain_name

from common import SMALL_MODEL, build

TRAINABLE = "layers.*.attention.w*"  # the attention projections of every block
STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world = init_distributed("cpu", "gloo")
    results = {}
    for strategy in STRATEGIES:
        engine, spec, cfg = build([*SMALL_MODEL, f"parallel.strategy={strategy}", f"model.trainable=[{TRAINABLE!r}]"], world)
        before = {plain_name(k): v.clone() for k, v in engine.full_weights().items()}  # collective
        gen = torch.Generator().manual_seed(world.rank)
        for _ in range(2):
            tokens = torch.randint(0, spec.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len + 1), generator=gen)
            engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])], spec.loss)
            engine.step(1e-2)
        after = {plain_name(k): v for k, v in engine.full_weights().items()}
        optim = engine.state_dict()["optim"]  # collective: neutral, every rank
        if world.rank == 0:
            changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
            with_state = sorted({k.split(".", 1)[1].rsplit(".", 1)[0] for k in optim if k.startswith("state.")})
            results[strategy] = {"names": sorted(before), "changed": changed, "with_state": with_state}
        del engine
        gc.collect()
    if world.rank == 0:
        (Path(args.out) / "frozen.json").write_text(json.dumps(results))
    shutdown(world)


if __name__ == "__main__":
    main()
