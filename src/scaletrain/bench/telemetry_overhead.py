"""`scaletrain bench --suite telemetry`: what telemetry and the guards cost the training
loop. The figures in docs/telemetry.md come from it.

    scaletrain bench --suite telemetry [--nproc 2] [--rounds 3] [--steps 400] [--out DIR] [key=value ...]

Two parts:
1. In this process: the always-on recorder per step (the phase clock's marks and the
   watchdog's heartbeat, timed over 100,000 steps; on CUDA a mark records an event
   instead, a few microseconds more), and what one communication sample (a step under the
   profiler, its trace exported and analysed) and one weight digest add to a step of the
   tiny model.
2. End to end (--rounds 0: skipped): the same run with the defaults (a profiled
   communication sample every 200 steps, a weight hash every 100, the watchdog) against
   one with all three off, alternated A B A B to resist a noisy machine; per run the mean
   step time over its log intervals after the first (each interval's wall time includes its
   metrics sync), per variant the median over the rounds.
"""

from __future__ import annotations

import json
import shlex
import shutil
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from scaletrain.bench.runner import run_logged
from scaletrain.config import load_config, split_args
from scaletrain.errors import UserError
from scaletrain.models import LlamaSpec, resolve_shape
from scaletrain.resilience.watchdog import Watchdog
from scaletrain.resilience.weights import digest
from scaletrain.telemetry.clock import PhaseClock
from scaletrain.telemetry.comm import CommSampler

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS = ",".join(str(STDLIB / d / "*.py") for d in ("json", "email", "collections"))
DEFAULTS = ["model.preset=tiny", f"data.paths=[{CORPUS}]", "data.seq_len=64", "train.micro_batch=16", "run.device=cpu"]
OFF = ["telemetry.comm_sample_every=0", "guards.weight_hash_every=0", "guards.hang_timeout_s=0"]
VARIANTS = {"off": OFF, "defaults": []}  # run in this order in every round


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


def sampled_and_hash_cost(preset: str = "tiny", micro_batch: int = 16, seq_len: int = 64) -> tuple[float, float, float]:
    """(plain step, extra seconds of one communication sample, one weight digest): a
    training step of the built-in model in this process, with and without the sampler
    (profiler on, trace exported and analysed), medians of 10."""
    torch.manual_seed(0)
    cfg = load_config([], [f"model.preset={preset}", f"data.seq_len={seq_len}"])
    spec = LlamaSpec(resolve_shape(cfg.model, 512))
    model = spec.build_meta(seq_len)
    spec.materialize(model, torch.device("cpu"), 0)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 512, (micro_batch, seq_len + 1))

    def step() -> None:
        spec.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    sampler = CommSampler(1, torch.device("cpu"))
    for _ in range(3):
        step()
    plain, sampled, hashed = [], [], []
    for i in range(10):
        t0 = time.perf_counter()
        step()
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with sampler.around(i + 1):
            step()
        sampled.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        digest(model.parameters())
        hashed.append(time.perf_counter() - t0)
    base = statistics.median(plain)
    return base, statistics.median(sampled) - base, statistics.median(hashed)


def step_time(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    intervals = [r for r in rows if r.get("event") == "interval"][1:]
    # The mean, not the median: the sampled and hashed steps are a few intervals in many,
    # which a median would leave out, and they are the cost being measured.
    return sum(r["wall_s"] for r in intervals) / sum(r["steps"] for r in intervals)


def commands(words: list[str], *, out: Path, nproc: int, rounds: int, steps: int) -> list[tuple[int, str, Path, list[str]]]:
    """(round, variant, run directory, command) of each end-to-end run, in the order they run."""
    runs = []
    for r in range(rounds):
        for name, extra in VARIANTS.items():
            run = out / f"{name}{r}"
            cfg = [*DEFAULTS, f"train.steps={steps}", "checkpoint.every=0", f"run.dir={run}", *words, *extra]
            runs.append((r, name, run, [sys.executable, "-m", "scaletrain", "launch", "--nproc", str(nproc), *cfg]))
    return runs


def check(words: list[str], *, nproc: int, rounds: int, steps: int) -> None:
    """The runs' config, and enough intervals to time: said before anything is measured."""
    if nproc < 1 or rounds < 0:
        raise UserError(f"--nproc {nproc} --rounds {rounds}: accepted: --nproc at least 1, --rounds at least 0")
    files, overrides = split_args([*DEFAULTS, f"train.steps={steps}", *words])
    t = load_config(files, overrides).train
    if rounds and t.steps < 2 * t.log_every:
        raise UserError(
            f"train.steps={t.steps} gives fewer than 2 intervals of train.log_every={t.log_every} steps (the first is "
            f"warm-up and left out); accepted: --steps of at least {2 * t.log_every}"
        )


def run_suite(words: list[str], *, out: Path, nproc: int, rounds: int, steps: int, dry_run: bool) -> int:
    check(words, nproc=nproc, rounds=rounds, steps=steps)
    runs = commands(words, out=out, nproc=nproc, rounds=rounds, steps=steps)
    if dry_run:
        for *_, cmd in runs:
            print(shlex.join(cmd))
        return 0
    cost = per_step_cost()
    print(f"recorder per step (clock start + 4 marks + heartbeat, CPU): {cost * 1e6:.2f} us")
    base, sample, digest_s = sampled_and_hash_cost()
    print(
        f"one step (tiny, micro-batch 16 x 64, 1 process) {base * 1e3:.1f} ms; one communication sample adds "
        f"{sample * 1e3:.1f} ms ({sample / (200 * base):.2%} of the step at comm_sample_every=200); one weight digest "
        f"{digest_s * 1e3:.2f} ms ({digest_s / (100 * base):.3%} at weight_hash_every=100)"
    )
    if not runs:
        return 0
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r, name, run, cmd in runs:
        shutil.rmtree(run, ignore_errors=True)
        run_logged(cmd, out / f"{name}{r}.log", f"the {name} run of round {r}")
        times[name].append(step_time(run))
        print(f"round {r} {name:8s} median step {times[name][-1] * 1e3:.2f} ms", flush=True)
    off, on = statistics.median(times["off"]), statistics.median(times["defaults"])
    print(f"median step: guards and sampling off {off * 1e3:.2f} ms, defaults {on * 1e3:.2f} ms: {on / off - 1:+.2%}")
    print(f"runs: {' '.join(f'{t * 1e3:.2f}' for t in times['off'])} | {' '.join(f'{t * 1e3:.2f}' for t in times['defaults'])}")
    print(f"recorder per step: {cost / off:.3%} of the step")
    return 0
