"""Probe: the host synchronisations of one forward and backward of a mixture of experts
under expert parallelism (tests/test_moe_syncs.py), counted on each rank with
tests/sync_counter.py. Run under torchrun at world 2: each rank holds 4 of the 8 experts of
each MoE layer (plain tensors, its slice: the layer's all-to-all is what is counted, not
DTensor's bookkeeping) and routes its own tokens. Rank 0 writes {path: count} to --out."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.config import load_config
from scaletrain.engines.block_wrappers import apply_activation_checkpointing
from scaletrain.models.moe import moe_layers
from scaletrain.models.presets import resolve_shape
from scaletrain.models.spec import LlamaSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: sync_counter
from sync_counter import SyncCounter  # noqa: E402

MODEL = ["model.preset=tiny-moe", "model.n_layers=2", "model.dim=32", "model.n_heads=2", "model.n_kv_heads=2"]


def count(impl: str, recomputed: bool) -> int:
    spec = LlamaSpec(resolve_shape(load_config([], [*MODEL, f"model.moe.experts_impl={impl}"]).model, 64))
    model = spec.build_meta(16)
    spec.materialize(model, torch.device("cpu"), seed=0)
    rank, ep = dist.get_rank(), dist.get_world_size()
    for layer in moe_layers(model):
        local = layer.n_experts // ep
        for name in ("w1", "w2", "w3"):
            whole = layer.experts.get_parameter(name)
            setattr(layer.experts, name, nn.Parameter(whole.detach()[rank * local : (rank + 1) * local].clone()))
        layer.ep_group = dist.group.WORLD
    if recomputed:
        apply_activation_checkpointing(spec.blocks(model))
    inputs = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    spec.loss(model(inputs[:, :-1]), inputs[:, 1:]).backward()  # a first pass: the grouped kernel's probe
    with SyncCounter() as syncs:
        spec.loss(model(inputs[:, :-1]), inputs[:, 1:]).backward()
    return syncs.count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    dist.init_process_group("gloo")
    try:
        counted = {"grouped": count("grouped", False), "loop": count("loop", False)}
        counted["grouped_recomputed"] = count("grouped", True)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, counted)
        if dist.get_rank() == 0:
            assert all(c == counted for c in every), every
            out.write_text(json.dumps(counted))
        # Both ranks done with every collective before either tears its group down: a peer
        # closing its gloo pairs while the other still drains its own aborted rank 0 once
        # in a CI run ("terminate called without an active exception").
        dist.barrier()
    finally:
        # Models holding the group, freed first: gloo intermittently aborts when a group goes
        # with them alive (trainer.train does the same).
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
