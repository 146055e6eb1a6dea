"""`scaletrain verify RUN [--from STEP] [--steps N] [--nproc M]`: a resume anyone can audit.

It re-runs N steps of a run from its checkpoint at STEP (the newest by default) into a
scratch directory, as the run's own config says (train.stop_at ends it there; the schedule
stays the run's), and compares every figure the run recorded for those steps that a
correct engine reproduces: each step's loss, gradient norm, learning rate, tokens and the
guards' counters, and each evaluation's loss. Timing, memory and throughput are the
machine's, not the run's, and are not compared.

- The same layout (world size and parallel dims as the run recorded): bit for bit, as a
  resume is (tests/test_muon.py, tests/test_spikes.py check it for the engines).
- Another world size (--nproc M): the numbers differ by summation order; held to the
  tolerances the suite's engine equivalence tests hold every engine to over a few steps
  (tests/helpers/numerics.py): the loss and an evaluation within 1e-4 relative (the tests'
  1e-5 per step, with room for N steps of drift), the gradient norm within 5e-3.

Checkpoints in object storage (checkpoint.dir) are fetched when the run directory lacks
the one asked for. The re-run writes nothing to the run or its store: checkpoint.dir,
exports and the TensorBoard/W&B sinks are off in it. Exit 0 when everything matches, 1
naming the first step and figure that differ (or a re-run that failed), 2 on bad input.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scaletrain.checkpoint.manager import complete_checkpoints
from scaletrain.errors import UserError
from scaletrain.telemetry.metrics import read_metrics

STEP_FIGURES = ("loss", "grad_norm", "lr", "tokens", "loss_scale", "nonfinite_steps", "rollbacks")
EVAL_FIGURES = ("loss",)
# Across layouts (module docstring); None: exact even then (the schedule, the counters).
RTOL: dict[str, float | None] = {"loss": 1e-4, "grad_norm": 5e-3, "lr": 1e-12}
DEFAULT_STEPS = 5
# The re-run writes nowhere but its scratch directory.
QUIET = ["checkpoint.dir=null", "checkpoint.hf_every=0", "checkpoint.hf_last=false", "telemetry.tensorboard=false",
         "telemetry.wandb=false", "telemetry.profile_steps=[]"]  # fmt: skip


@dataclass(frozen=True)
class Difference:
    step: int
    what: str  # "loss", "eval loss", ...
    recorded: Any
    rerun: Any

    def line(self) -> str:
        floats = isinstance(self.recorded, float) and isinstance(self.rerun, float)
        by = f" ({(self.rerun - self.recorded) / abs(self.recorded):+.3g} relative)" if floats and self.recorded else ""
        shown = [f"{v:.10g}" if isinstance(v, float) else repr(v) for v in (self.recorded, self.rerun)]
        return f"step {self.step}: {self.what} {shown[0]} recorded, {shown[1]} re-run{by}"


def _close(a: Any, b: Any, rtol: float | None) -> bool:
    if a is None or b is None or rtol is None or not isinstance(a, float) or not isinstance(b, float):
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)


def compare(recorded: list[dict[str, Any]], rerun: list[dict[str, Any]], steps: range, exact: bool) -> list[Difference]:
    """Every difference of the figures compared over `steps`, in step order; a step the re-run
    has and the record lacks (or the reverse) is one too."""
    differences = []

    def by_step(rows: list[dict[str, Any]], kind: str | None) -> dict[int, dict[str, Any]]:
        return {int(r["step"]): r for r in rows if r.get("event") == kind and int(r["step"]) in steps}

    for kind, figures, label in ((None, STEP_FIGURES, ""), ("eval", EVAL_FIGURES, "eval ")):
        a, b = by_step(recorded, kind), by_step(rerun, kind)
        for step in sorted(set(a) | set(b)):
            if kind == "eval" and (step not in a or step not in b):
                continue  # an evaluation at the re-run's last step that the run had not scheduled
            if step not in a or step not in b:
                differences.append(
                    Difference(step, "the step's row", "present" if step in a else "absent", "present" if step in b else "absent")
                )
                continue
            for key in figures:
                x, y = a[step].get(key), b[step].get(key)
                if not _close(x, y, None if exact else RTOL.get(key)):
                    differences.append(Difference(step, label + key.replace("_", " "), x, y))
    return sorted(differences, key=lambda d: d.step)


def _checkpoint(run: Path, cfg: dict[str, Any], step: int | None, last: int, scratch: Path) -> tuple[Path, int]:
    """The checkpoint to start from (local, or fetched from checkpoint.dir into `scratch`): at
    `step`, or the newest with recorded steps after it (before `last`)."""
    local = dict(complete_checkpoints(run / "checkpoints"))
    url = (cfg.get("checkpoint") or {}).get("dir")
    stored: list[int] = []
    if url:
        from scaletrain.checkpoint.remote import CheckpointStore

        store = CheckpointStore(url)
        stored = store.complete()
    have = [s for s in sorted(set(local) | set(stored)) if s < last]
    if not have:
        raise UserError(
            f"{run}: no complete checkpoint before its last recorded step ({last}) to verify from; accepted: a run "
            "with checkpoint.every below its length"
        )
    chosen = have[-1] if step is None else step
    if chosen not in have:
        raise UserError(
            f"{run}: no complete checkpoint with recorded steps after it at step {chosen}; accepted: --from "
            f"{'|'.join(map(str, have))}"
        )
    if chosen in local:
        return local[chosen], chosen
    return store.download(chosen, scratch / "fetched"), chosen


def _same_batch(info: dict[str, Any], ranks: int) -> list[str]:
    """On another world size, the run's global batch kept (the same samples each step): its
    micro-batch where it divides what each data-parallel rank now takes, else smaller."""
    batch, parallel = info.get("batch") or {}, info.get("parallel") or {}
    total, micro = int(batch.get("global_batch") or 0), int(batch.get("micro_batch") or 1)
    model_parallel = int(parallel.get("tp", 1)) * int(parallel.get("pp", 1)) * int(parallel.get("cp", 1))
    dp = ranks // model_parallel if ranks % model_parallel == 0 else 0
    if not total or not dp or total % dp:
        raise UserError(
            f"--nproc {ranks}: the run's global batch of {total or '?'} sequences (tp x pp x cp = {model_parallel}) does "
            f"not split over {dp or ranks} data-parallel ranks; accepted: --nproc with a data-parallel size dividing it"
        )
    per_rank = total // dp
    micro = max(m for m in range(1, min(micro, per_rank) + 1) if per_rank % m == 0)
    return [f"train.global_batch={total}", f"train.micro_batch={micro}", "train.grad_accum=1"]


def verify(run: str | Path, from_step: int | None, steps: int | None, nproc: int | None, scratch: Path | None) -> int:
    run = Path(run)
    config, metrics = run / "config.yaml", run / "metrics.jsonl"
    if not config.is_file() or not metrics.is_file():
        raise UserError(
            f"{run} is not a run directory (no config.yaml and metrics.jsonl); accepted: a run.dir of scaletrain train"
        )
    cfg = yaml.safe_load(config.read_text())
    recorded = read_metrics(metrics, events=True)
    last = max((int(r["step"]) for r in recorded if "event" not in r), default=0)
    info = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
    world = int(info.get("world_size", 1))
    scratch = Path(scratch) if scratch else run / "verify"
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    ckpt, start = _checkpoint(run, cfg, from_step, last, scratch)
    stop = min(last, start + (steps or DEFAULT_STEPS))
    ranks = nproc or world
    args = [str(config), f"run.dir={scratch / 'run'}", f"train.resume={ckpt}", f"train.stop_at={stop}", *QUIET]
    if ranks != world:
        args += _same_batch(info, ranks)
    command = [sys.executable, "-m", "scaletrain", *(["launch", "--nproc", str(ranks)] if ranks > 1 else ["train"]), *args]
    print(
        f"verify: steps {start + 1}-{stop} of {run}, from {ckpt} on {ranks} rank(s) ({'the same layout: bit for bit' if ranks == world else f'the run had {world}: within the tolerances'})"
    )
    log = scratch / "rerun.log"
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy(), check=False)
    if done.returncode != 0:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:] or ["(no output)"]
        print(f"verify: the re-run failed (exit {done.returncode}): {tail[0]} (all of it: {log})")
        return 1
    rerun = read_metrics(scratch / "run" / "metrics.jsonl", events=True)
    differences = compare(recorded, rerun, range(start + 1, stop + 1), exact=ranks == world)
    if not differences:
        print(f"verify: the same: {stop - start} steps' loss, gradient norm, learning rate and counters, and evaluations")
        return 0
    print(f"verify: differs from step {differences[0].step}: {differences[0].line()}")
    for d in differences[1:10]:
        print(f"  {d.line()}")
    if len(differences) > 10:
        print(f"  and {len(differences) - 10} more")
    return 1
