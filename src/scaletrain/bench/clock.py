"""`scaletrain bench --suite clock`: the planner's clock (planning/clock) against measured
steps on this CPU. The table in docs/planner.md ("The clock on this CPU") comes from it.

    scaletrain bench --suite clock [--rounds 2] [--steps 12] [--out DIR] [--docs FILE.md] [--only NAME,...]

First `scaletrain plan --calibrate`'s measurements (the host's cost per operation, gloo's
collectives between two processes) into a cache of the bench's own (OUT/cache). Then, round
after round, each configuration is predicted and at once run: the prediction replays the
configuration's operations afresh (the round's replays are dropped before it), so that
prediction and run see the machine in the same state; the run is `scaletrain train` (world 1)
or `torchrun --nproc-per-node 2 -m scaletrain train` (world 2), its measured step the median
of its log intervals after the first (each at least INTERVAL_S as predicted). Per configuration: the medians over the rounds of the
predicted and the measured step, the error of each round's prediction against its own run
(their median is the configuration's error), and the spread of the measured steps over the
rounds ((max - min) / median), which says how far this machine lets a check go.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.bench.clock_recorded import largest_phases, write_between
from scaletrain.bench.runner import run_logged

Say = Callable[[str], None]


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    overrides: tuple[str, ...]


SMALL = ("model.preset=small",)
FLOAT8 = ("precision=bf16", "train.float8=true")
# At least one of each engine, layout and size the clock prices on a CPU (issue 55 item 4):
# tiny and small, seq 64 to 1024, micro-batch 1 to 16, activation checkpointing on and off,
# ddp, fsdp, zero2 and zero3 at world 1 and 2, tp 2, pp 2, cp 2 in both designs, a mixture of
# experts, and float8.
CASES = (
    Case("tiny ddp mb16 s128", 1, ("model.preset=tiny", "data.seq_len=128", "train.micro_batch=16", "parallel.strategy=ddp")),
    Case("tiny ddp mb1 s64", 1, ("model.preset=tiny", "data.seq_len=64", "train.micro_batch=1", "parallel.strategy=ddp")),
    Case("small ddp mb8 s256", 1, (*SMALL, "data.seq_len=256", "train.micro_batch=8", "parallel.strategy=ddp")),
    Case("small ddp mb8 s256 AC", 1, (*SMALL, "data.seq_len=256", "train.micro_batch=8", "parallel.strategy=ddp", "parallel.activation_checkpointing=true")),
    Case("small fsdp mb2 s1024", 1, (*SMALL, "data.seq_len=1024", "train.micro_batch=2", "parallel.strategy=fsdp")),
    Case("small zero2 mb4 s256", 1, (*SMALL, "data.seq_len=256", "train.micro_batch=4", "parallel.strategy=zero2")),
    Case("small ddp mb4 s256", 2, (*SMALL, "data.seq_len=256", "train.micro_batch=4", "parallel.strategy=ddp")),
    Case("small fsdp mb4 s256", 2, (*SMALL, "data.seq_len=256", "train.micro_batch=4", "parallel.strategy=fsdp")),
    Case("small fsdp mb4 s256 AC", 2, (*SMALL, "data.seq_len=256", "train.micro_batch=4", "parallel.strategy=fsdp", "parallel.activation_checkpointing=true")),
    Case("small zero2 mb4 s256", 2, (*SMALL, "data.seq_len=256", "train.micro_batch=4", "parallel.strategy=zero2")),
    Case("small zero3 mb4 s256", 2, (*SMALL, "data.seq_len=256", "train.micro_batch=4", "parallel.strategy=zero3")),
    Case("small fsdp tp2 mb4 s256", 2, (*SMALL, "data.seq_len=256", "train.micro_batch=4", "parallel.strategy=fsdp", "parallel.tp=2")),
    Case("small fsdp pp2 mb4x4 s256", 2, (*SMALL, "model.tie_embeddings=false", "data.seq_len=256", "train.micro_batch=4", "train.grad_accum=4", "parallel.strategy=fsdp", "parallel.pp=2")),
    Case("small fsdp cp2 mb2 s1024", 2, (*SMALL, "data.seq_len=1024", "train.micro_batch=2", "parallel.strategy=fsdp", "parallel.cp=2")),
    Case("small fsdp cp2 ulysses mb2 s1024", 2, (*SMALL, "data.seq_len=1024", "train.micro_batch=2", "parallel.strategy=fsdp", "parallel.cp=2", "parallel.cp_mode=ulysses")),
    Case("tiny-moe fsdp ep2 mb8 s128", 2, ("model.preset=tiny-moe", "data.seq_len=128", "train.micro_batch=8", "parallel.strategy=fsdp", "parallel.ep=2")),
    # train.float8 (torch._scaled_mm runs on this CPU): its block traced with torchao's layers.
    Case("small ddp mb8 s256 float8", 1, (*SMALL, "data.seq_len=256", "train.micro_batch=8", "parallel.strategy=ddp", *FLOAT8)),
    Case("small fsdp mb4 s256 float8", 2, (*SMALL, "data.seq_len=256", "train.micro_batch=4", "parallel.strategy=fsdp", *FLOAT8)),
)  # fmt: skip


@dataclass
class Result:
    case: Case
    predicted: list[float] = field(default_factory=list)  # per round
    measured: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # the last round's prediction, by phase
    measured_phases: dict[str, float] = field(default_factory=dict)  # the last round's run, by telemetry's phases

    @property
    def errors(self) -> list[float]:
        return [p / m - 1 for p, m in zip(self.predicted, self.measured)]

    @property
    def error(self) -> float:
        return statistics.median(self.errors)

    @property
    def spread(self) -> float:
        return (max(self.measured) - min(self.measured)) / statistics.median(self.measured) if len(self.measured) > 1 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.case.name,
            "world": self.case.world,
            "overrides": list(self.case.overrides),
            "predicted_s": self.predicted,
            "measured_s": self.measured,
            "error": self.error,
            "spread": self.spread,
            "phases": self.phases,
            "measured_phases": self.measured_phases,
        }


RUN = ("train.resume=never", "checkpoint.every=0", "run.device=cpu")
INTERVAL_S = 0.5  # the least predicted length of a log interval


def predict(case: Case) -> Any:
    """The clock's step for `case` as `scaletrain plan --configured-only --gpu cpu` gives it."""
    from scaletrain.config import load_config
    from scaletrain.config.batch import settle
    from scaletrain.config.parallel import dims_for
    from scaletrain.planning import planning_spec
    from scaletrain.planning.clock.step import step_time
    from scaletrain.planning.hardware import this_cpu
    from scaletrain.planning.planner import setups_for

    cfg = load_config([], [*case.overrides, "run.device=cpu"])
    cfg = settle(cfg, dims_for(cfg.parallel, case.world).dp_size)
    spec = planning_spec(cfg)
    setup = setups_for(cfg, case.world, 1, False, spec)[0]
    return step_time(spec, setup, cfg, this_cpu(), 1)


def measure(case: Case, steps: int, log_every: int, run_dir: Path) -> tuple[float, dict[str, float]]:
    """One run of `case`: the median step of its log intervals after the first, and its phases."""
    # Several ranks as users start them: `scaletrain launch` (a private rendezvous, the ranks
    # forked from its agent where torch has no GPU: ~5 s of imports less per rank than
    # torchrun starting new Pythons; the steps timed are the same).
    command = ["launch", "--nproc", str(case.world)] if case.world > 1 else ["train"]
    # The bench's own folder for this configuration and round: an earlier bench into the same
    # --out left its run there (its checkpoint, which train.resume=never refuses to train over),
    # and that bench's summary.json is replaced as well.
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "scaletrain",
        *command,
        *case.overrides,
        *RUN,
        f"train.steps={steps}",
        f"train.log_every={log_every}",
        f"run.dir={run_dir}",
    ]
    run_logged(cmd, run_dir.parent / f"{run_dir.name}.log", f"the run of {case.name!r}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    intervals = [r for r in rows if r.get("event") == "interval"][1:]
    step = statistics.median(r["step_s"] for r in intervals)
    phases = {
        k: statistics.median(r["phases"][k] for r in intervals)
        for k in ("data_s", "forward_s", "backward_s", "optimizer_s", "other_s")
        if all(r["phases"].get(k) is not None for r in intervals)
    }
    return step, phases


def calibrate(say: Say) -> None:
    """`scaletrain plan --calibrate` into this process's cache."""
    from scaletrain.bench.engine_overhead import engine_overheads
    from scaletrain.planning.clock.calibrate import calibrate_cpu, save_calibration

    values, lines = calibrate_cpu()
    for line in lines:
        say(f"calibrated: {line}")
    values["engines"] = engine_overheads(lambda line: say(f"calibrated: {line}"))
    save_calibration(values)


QUIET_WAIT_S = 120.0  # the longest the bench waits for other processes to leave the CPUs


def wait_for_quiet(say: Say) -> bool:
    """Calibrate on a quiet machine: wait (at most QUIET_WAIT_S) for other processes to stop
    using the CPUs, saying how long it waited, or that it goes on busy (False)."""
    import torch

    from scaletrain.planning.clock import contention

    waited, others = contention.wait_quiet(torch.get_num_threads(), QUIET_WAIT_S)
    if others is not None:
        say(
            f"the machine is still busy after {waited:.0f} s (other processes use {others:.1f} of its {contention.cores()} cores): measuring anyway"
        )
        return False
    if waited >= contention.QUIET_PROBES * contention.REPROBE_S:
        say(f"waited {waited:.0f} s for other processes to leave the CPUs")
    return True


def forget_replays() -> None:
    """Drop the replayed operations' times, so that the next prediction measures them again."""
    from scaletrain import disk_cache
    from scaletrain.planning.clock import compute, cpu_measured, rates

    for cached in (
        cpu_measured._replayed,
        cpu_measured._measured_optimizer,
        cpu_measured.cpu_host_op,
        cpu_measured.cpu_bandwidth,
        cpu_measured.cpu_in_sequence,
        rates._cpu_rates,
    ):
        cached.cache_clear()
    compute.forget()
    disk_cache.forget(cpu_measured.CALLS_FILE)


def run_suite(
    rounds: int, steps: int, out: Path, only: list[str] | None, docs: Path | None, say: Say, refresh: bool = True
) -> list[Result]:
    """Each configuration predicted, then run at once. `refresh`: its operations replayed
    afresh just before (the bench: prediction and run under the same state of the machine);
    without it, a shape an earlier configuration replayed keeps its time, as a user's cache
    keeps it (the suite's test: the same shapes are not replayed again)."""
    cases = [c for c in CASES if not only or c.name in only or f"{c.name} w{c.world}" in only]
    unknown = sorted(set(only or ()) - {c.name for c in CASES} - {f"{c.name} w{c.world}" for c in CASES})
    if unknown:
        from scaletrain.errors import UserError

        raise UserError(f"--only {', '.join(unknown)}: no such configuration; accepted: {', '.join(c.name for c in CASES)}")
    out.mkdir(parents=True, exist_ok=True)
    os.environ["SCALETRAIN_CACHE"] = str((out / "cache").resolve())  # the runs read the same calibration
    # A machine found busy past QUIET_WAIT_S is taken as it is from then on: its "busy" is its
    # usual state, and waiting before each configuration would only add that wait 18 times.
    patient = wait_for_quiet(say)
    calibrate(say)
    results = [Result(c) for c in cases]
    log_every = max(1, steps // 4)
    for r in range(rounds):
        for res in results:
            if refresh:
                # Replayed on a quiet machine, as the run after it is timed: never beside the last
                # run's exiting ranks. (It did not explain the predictions that moved 1.5x between
                # rounds on 2026-12-01: a bench with this wait never had to wait.)
                patient = patient and wait_for_quiet(say)
                forget_replays()
            predicted, patient = _predicted_quietly(res.case, say, patient)
            # A step of milliseconds is timed over more of them: each log interval at least
            # INTERVAL_S long as predicted, so that one slow moment of the machine is a small
            # part of it (the tiny preset at micro-batch 1: 20 ms steps).
            every = max(log_every, math.ceil(INTERVAL_S / max(predicted.total, 1e-3)))
            run_dir = out / "runs" / f"{_slug(res.case.name)}-w{res.case.world}-{r}"
            step, phases = measure(res.case, max(steps, 4 * every + 1), every, run_dir)
            res.predicted.append(predicted.total)
            res.measured.append(step)
            res.phases, res.measured_phases = predicted.phases, phases
            say(
                f"round {r + 1}/{rounds} {res.case.name}: predicted {predicted.total:.3f} s, measured {step:.3f} s ({predicted.total / step - 1:+.1%}); "
                + _phases_side_by_side(predicted.phases, phases)
            )
    (out / "summary.json").write_text(json.dumps([x.as_dict() for x in results], indent=1) + "\n")
    if docs is not None:
        write_table(docs, results, rounds, steps)
    return results


def _phases_side_by_side(predicted: dict[str, float], measured: dict[str, float]) -> str:
    """'forward 0.120/0.131, backward ...': each phase telemetry measures, predicted/measured
    seconds, so that a miss names its phase (a failure on another machine is read from this)."""
    return ", ".join(
        f"{k} {predicted.get(k, 0.0):.3f}/{measured[f'{k}_s']:.3f}"
        for k in ("forward", "backward", "optimizer")
        if f"{k}_s" in measured
    )


def _predicted_quietly(case: Case, say: Say, patient: bool) -> tuple[Any, bool]:
    """predict(case); where some of its operations were timed while other work held the CPUs
    (clock/contention.py: those times are slow, and kept only while the machine stays busy),
    once more after waiting for a quiet machine, which times them again. `patient`: whether
    to wait (else the machine was found busy past the wait before); returned as it stands."""
    from scaletrain.planning.clock import cpu_measured

    cpu_measured.BUSY_MEASURED.clear()  # the bench's own process: what this prediction used
    predicted = predict(case)
    if cpu_measured.BUSY_MEASURED and patient:
        say(
            f"{case.name}: {len(cpu_measured.BUSY_MEASURED)} of its operations were timed on a busy machine: again, once it is quiet"
        )
        patient = wait_for_quiet(say)
        predicted = predict(case)
    return predicted, patient


def _slug(name: str) -> str:
    return name.replace(" ", "-")


MARKER = "clock-cpu-table"  # docs/planner.md's table sits between <!-- MARKER --> and <!-- /MARKER -->


def table(results: list[Result], rounds: int, steps: int) -> str:
    rows = [
        "| configuration | world | predicted s/step | measured s/step | error | spread of the runs | largest predicted phases |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in results:
        rows.append(
            f"| {x.case.name} | {x.case.world} | {statistics.median(x.predicted):.3f} | {statistics.median(x.measured):.3f} "
            f"| {x.error:+.1%} | {x.spread:.0%} | {largest_phases(x.phases, lambda v: f'{v:.3f}')} |"
        )
    errors = [abs(x.error) for x in results]
    rows.append("")
    rows.append(
        f"{len(results)} configurations, {rounds} rounds of {steps} steps each: median |error| {statistics.median(errors):.1%}, "
        f"largest {max(errors):.1%}."
    )
    return "\n".join(rows)


def write_table(docs: Path, results: list[Result], rounds: int, steps: int) -> None:
    write_between(docs, MARKER, table(results, rounds, steps))


def summary(results: list[Result]) -> dict[str, Any]:
    return {"results": [asdict(x.case) | {"error": x.error, "spread": x.spread} for x in results]}
