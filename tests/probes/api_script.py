"""Probe: a program that trains, plans and evaluates through scaletrain's Python API, as a
user's script would, under torchrun. With --caller-group the script makes the process
group itself first: scaletrain must use it and leave it alone (the script all-reduces on it
afterwards). Each rank writes OUT/rank<R>.json: what the API returned, and the group's
state after it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import scaletrain

p = argparse.ArgumentParser()
p.add_argument("--out", type=Path, required=True)
p.add_argument("--caller-group", action="store_true")
p.add_argument("overrides", nargs="*")
args = p.parse_args()

if args.caller_group:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mine = dist.group.WORLD

cfg = scaletrain.load_config(overrides=args.overrides)
plan = scaletrain.plan(cfg, gpu="cpu", gpus_per_node=2)
summary = scaletrain.train(cfg)
row = scaletrain.evaluate(summary.run_dir)
got = {
    "summary": {k: str(v) if isinstance(v, Path) else v for k, v in vars(summary).items()},
    "plan": {"chosen_strategy": plan.as_dict()["chosen_strategy"], "world": plan.world},
    "eval": row,
}
if args.caller_group:
    got["group_kept"] = dist.is_initialized() and dist.group.WORLD is mine
    total = torch.ones(1)
    dist.all_reduce(total)  # the caller's group still works
    got["all_reduce"] = total.item()
    # Every rank past the all-reduce before any tears its connections down: a rank that
    # destroyed the group while the other still finished it aborted in gloo once
    # ("terminate called without an active exception", as tests/probes/moe_syncs.py did).
    dist.barrier()
    dist.destroy_process_group()
(args.out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(got))
