"""Probe: does analyze_trace see communication that a slow peer makes this rank wait for?

Run under torchrun (world 2, gloo). A small DDP model trains 7 steps with two
ProfileWindows: steps 3-4 as they are (`base`), steps 6-7 with a comm hook that sleeps
--delay-ms on rank --delay-rank before its all-reduce (`delayed`). Steps 1-2 (DDP's bucket
rebuild, the optimizer's lazy state: the ranks drift apart) and step 5 (the first delayed
one) stay outside both. Each rank writes OUT/rank<R>.json:
{"base": analyze_trace(...), "delayed": ..., "traces": {name: path}}.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from scaletrain.distributed import init_distributed, shutdown
from scaletrain.telemetry.profile import ProfileWindow, analyze_trace

from common import SMALL_MODEL, build

WINDOWS = {"base": [3, 4], "delayed": [6, 7]}
DELAY_FROM = 5
STEPS = 7
SEQ, VOCAB = 16, 67  # SMALL_MODEL's


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--delay-ms", type=float, default=150.0)
    ap.add_argument("--delay-rank", type=int, default=1)
    args = ap.parse_args()
    out = Path(args.out)
    world = init_distributed("cpu", "gloo")
    engine, spec, cfg = build([*SMALL_MODEL, "parallel.strategy=ddp"], world)
    delay = {"s": 0.0}

    def late_allreduce(process_group, bucket):
        time.sleep(delay["s"])  # on the training thread (autograd's), before the collective starts
        return default_hooks.allreduce_hook(process_group, bucket)

    engine.model.register_comm_hook(None, late_allreduce)
    windows = {name: ProfileWindow(steps, out / name, world.rank, world.device) for name, steps in WINDOWS.items()}
    gen = torch.Generator().manual_seed(world.rank)
    for step in range(1, STEPS + 1):
        if step == DELAY_FROM and world.rank == args.delay_rank:
            delay["s"] = args.delay_ms / 1000
        for w in windows.values():
            w.before_step(step)
        base, delayed = windows["base"], windows["delayed"]
        with base.phase("data"), delayed.phase("data"):
            tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
        with base.phase("forward_backward"), delayed.phase("forward_backward"):
            engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])], spec.loss)
        with base.phase("optimizer"), delayed.phase("optimizer"):
            engine.step(1e-3)
        for w in windows.values():
            w.after_step(step)
    result: dict = {"traces": {}}
    for name, w in windows.items():
        w.close()
        assert w.written is not None, f"{name}: no trace written"
        result[name] = analyze_trace(w.written)
        result["traces"][name] = str(w.written)
    (out / f"rank{world.rank}.json").write_text(json.dumps(result))
    del engine  # no live DDP model at teardown (gloo may abort)
    gc.collect()
    shutdown(world)


if __name__ == "__main__":
    main()
