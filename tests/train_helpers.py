"""Running `scaletrain` the way users do (CLI, torchrun) and reading what it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from scaletrain.checkpoint import read_model_weights
from scaletrain.telemetry import read_metrics

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# A small, fixed corpus every Python has: enough tokens for short runs, quick to tokenize.
SMALL_CORPUS = [str(STDLIB / "json" / "*.py"), str(STDLIB / "email" / "*.py"), str(STDLIB / "collections" / "*.py")]


def base_overrides(data_dir: Path, run_dir: Path, steps: int = 10) -> list[str]:
    return [
        "model.preset=tiny",
        f"data.paths={data_dir}",
        "data.seq_len=64",
        f"train.steps={steps}",
        "train.warmup_steps=2",
        "train.lr=3e-3",
        "train.log_every=5",
        "run.device=cpu",
        f"run.dir={run_dir}",
    ]


def run_scaletrain(
    args: list[str], nproc: int = 1, env: dict[str, str] | None = None, timeout: float = 240, one_thread: bool = True
) -> subprocess.CompletedProcess:
    """One intra-op thread by default: ranks sharing 2 cores don't oversubscribe, and every
    run in an equivalence test does its float reductions the same way."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "scaletrain", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "scaletrain", *args]
    full_env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if one_thread else {}), **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def losses(run_dir: Path) -> list[float]:
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "one row per optimizer step, in order"
    return [r["loss"] for r in rows]


def final_weights(run_dir: Path, step: int):
    return read_model_weights(run_dir / "checkpoints" / f"step_{step}")
