"""Probe: a frozen base on every engine. Run under torchrun.

For each strategy: build the engine exactly as `train` does with model.trainable set, take
the full weights, run 2 optimizer steps on random tokens, take them again and the
engine-neutral optimizer state. Rank 0 writes OUT/frozen.json: per strategy, the frozen
and trainable parameter names that changed and the parameters with optimizer state.

Then checkpoints without the frozen parameters (checkpoint.frozen=reference): each engine
saves one as the trainer does; a fresh engine (its frozen parameters from the seeded base)
loads it natively, and the previous strategy's too (resharded or converted, and verified
by restore itself). Per strategy: the weights the checkpoint holds, and whether the fresh
engine then equals the trained one, every weight and moment bit for bit.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from scaletrain import checkpoint
from scaletrain.checkpoint.frozen_base import base_reference
from scaletrain.checkpoint.neutral import ParamLayout, read_state
from scaletrain.checkpoint.restore import first_difference, restore
from scaletrain.checkpoint.state import TrainerState
from scaletrain.config.parallel import dims_for
from scaletrain.engines.block_wrappers import plain_name
from scaletrain.launch.distributed import init_distributed, shutdown

from common import SMALL_MODEL, build

TRAINABLE = "layers.*.attention.w*"  # the attention projections of every block
STRATEGIES = ["ddp", "fsdp", "zero1", "zero2", "zero3"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    world = init_distributed("cpu", "gloo")
    results = {}
    saved = None  # the previous strategy's checkpoint
    for strategy in STRATEGIES:
        overrides = [
            *SMALL_MODEL,
            f"parallel.strategy={strategy}",
            f"model.trainable=[{TRAINABLE!r}]",
            "checkpoint.frozen=reference",
        ]
        engine, spec, cfg = build(overrides, world)
        before = {plain_name(k): v.clone() for k, v in engine.full_weights().items()}  # collective
        gen = torch.Generator().manual_seed(world.rank)
        for _ in range(2):
            tokens = torch.randint(0, spec.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len + 1), generator=gen)
            engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])], spec.loss)
            engine.step(1e-2)
        after = {plain_name(k): v for k, v in engine.full_weights().items()}
        optim = engine.state_dict()["optim"]  # collective: neutral, every rank
        trained = engine.state_dict()  # collective
        ckpt = Path(args.out) / strategy
        state = TrainerState(
            step=2, data_position=0, tokens_seen=0, world_size=world.world_size, format=engine.format, engine=engine.name,
            parallel=dims_for(cfg.parallel, world.world_size).as_dict(), model=spec.config(), data_fingerprint="x",
            base=base_reference(cfg),
        )  # fmt: skip
        checkpoint.save_checkpoint(ckpt, world, engine.save, state, {})
        layout = ParamLayout(spec.build_meta(cfg.data.seq_len))
        if world.rank == 0:
            changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
            with_state = sorted({k.split(".", 1)[1].rsplit(".", 1)[0] for k in optim if k.startswith("state.")})
            held = sorted(read_state(ckpt, layout)["model"])
            results[strategy] = {"names": sorted(before), "changed": changed, "with_state": with_state, "held": held}
        del engine
        gc.collect()
        fresh, _, _ = build(overrides, world)
        how = restore(ckpt, world, fresh, layout, state.parallel)
        problem = first_difference(fresh.state_dict(), trained)  # every weight (frozen ones from the base) and moment
        # The previous engine's checkpoint: resharded or converted, which restore verifies itself.
        how_other = restore(saved, world, fresh, layout, state.parallel) if saved else None
        if world.rank == 0:
            results[strategy] |= {"reloaded": how, "difference": problem, "previous": how_other}
        saved = ckpt
        del fresh
        gc.collect()
    if world.rank == 0:
        (Path(args.out) / "frozen.json").write_text(json.dumps(results))
    shutdown(world)


if __name__ == "__main__":
    main()
