"""What telemetry and the guards cost the training loop. The figures in docs/telemetry.md
come from it.

    python bench/telemetry_overhead.py [--nproc 2] [--rounds 3] [--steps 400] [key=value ...]

Two parts:
1. The always-on recorder, per step: the phase clock's marks and the watchdog's heartbeat,
   timed in a loop of 100,000 steps on this machine's CPU (on CUDA a mark records an event
   instead, a few microseconds more).
2. End to end: the same run with the defaults (a profiled communication sample every 200
   steps, a weight hash every 100, the watchdog) against one with all three off, alternated
   A B A B to resist a noisy machine; per run the mean step time over its log intervals
   after the first (each interval's wall time includes its metrics sync), per variant the
   median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from scaletrain.guards.watchdog import Watchdog
from scaletrain.telemetry.clock import PhaseClock

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS = ",".join(str(STDLIB / d / "*.py") for d in ("json", "email", "collections"))
DEFAULTS = ["model.preset=tiny", f"data.paths=[{CORPUS}]", "data.seq_len=64", "train.micro_batch=16", "run.device=cpu"]
OFF = ["telemetry.comm_sample_every=0", "guards.weight_hash_every=0", "guards.hang_timeout_s=0"]


def per_step_cost(n: int = 100_000) -> float:
    """Seconds the recorder adds to one step: start, four marks, one heartbeat."""
    clock = PhaseClock(torch.device("cpu"))
    dog = Watchdog.__new__(Watchdog)  # no thread: only the heartbeat's own cost
    dog.step, dog._beat = 0, 0.0
    t0 = time.perf_counter()
    for step in range(n):
        clock.start()
        for phase in ("data", "forward", "backward", "optimizer"):
            clock.mark(phase)
        dog.beat(step)
    return (time.perf_counter() - t0) / n


def step_time(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    intervals = [r for r in rows if r.get("event") == "interval"][1:]
    # The mean, not the median: the sampled and hashed steps are a few intervals in many,
    # which a median would leave out, and they are the cost being measured.
    return sum(r["wall_s"] for r in intervals) / sum(r["steps"] for r in intervals)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", type=Path, default=Path("/tmp/telemetry-overhead"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cost = per_step_cost()
    print(f"recorder per step (clock start + 4 marks + heartbeat, CPU): {cost * 1e6:.2f} us")
    times: dict[str, list[float]] = {"off": [], "defaults": []}
    for r in range(args.rounds):
        for name, extra in (("off", OFF), ("defaults", [])):
            run = args.out / f"{name}{r}"
            shutil.rmtree(run, ignore_errors=True)
            cfg = [*DEFAULTS, f"train.steps={args.steps}", "checkpoint.every=0", f"run.dir={run}", *args.overrides, *extra]
            cmd = [sys.executable, "-m", "scaletrain", "launch", "--nproc", str(args.nproc), *cfg]
            subprocess.run(cmd, check=True, capture_output=True)
            times[name].append(step_time(run))
            print(f"round {r} {name:8s} median step {times[name][-1] * 1e3:.2f} ms", flush=True)
    off, on = statistics.median(times["off"]), statistics.median(times["defaults"])
    print(f"median step: guards and sampling off {off * 1e3:.2f} ms, defaults {on * 1e3:.2f} ms: {on / off - 1:+.2%}")
    print(f"runs: {' '.join(f'{t * 1e3:.2f}' for t in times['off'])} | {' '.join(f'{t * 1e3:.2f}' for t in times['defaults'])}")
    print(f"recorder per step: {cost / off:.3%} of the step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
