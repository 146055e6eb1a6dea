"""Probe: train.param_groups inside each engine's optimizer. One step at the scheduled lr
1e-2, then the engine-neutral state's learning rate and weight decay of some parameters
(what the optimizer stepped them with). Writes OUT/rank<R>.json, {strategy: {name: [lr, wd]}}."""

from __future__ import annotations

import gc

import torch

from scaletrain.models import loss_fn

from common import SMALL_MODEL, build, run_strategies

SEQ = 16  # SMALL_MODEL's data.seq_len
GROUPS = (
    'train.param_groups=[{match: ["tok_embeddings.*"], lr: 0.5, weight_decay: 0.0}, {match: ["*.attention_norm.*"], lr: 2.0}]'
)
NAMES = ("tok_embeddings.weight", "layers.0.attention_norm.weight", "layers.0.attention.wq.weight", "layers.0.ffn_norm.weight")


def probe_engine(strategy: str, world) -> dict:
    engine, _, _ = build([*SMALL_MODEL, f"parallel.strategy={strategy}", "train.weight_decay=0.1", GROUPS], world)
    tokens = torch.randint(0, 67, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])], loss_fn)
    engine.step(1e-2)
    optim = engine.state_dict()["optim"]  # collective
    report = {
        name: [float(optim[f"param_groups.{name}.lr"]), float(optim[f"param_groups.{name}.weight_decay"])] for name in NAMES
    }
    del engine
    gc.collect()
    return report


if __name__ == "__main__":
    run_strategies(probe_engine)
