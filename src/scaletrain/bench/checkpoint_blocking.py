"""`scaletrain bench --suite checkpoint`: how long the training loop stands still for a
checkpoint, checkpoint.async_save=false against true, same config, same machine. The
figures in docs/checkpointing.md come from it.

    scaletrain bench --suite checkpoint [--out DIR] [--nproc N] [CONFIG.yaml | key=value ...]

Runs `scaletrain train` (or `scaletrain launch --nproc N`) once per mode, reads the
checkpoint event rows of metrics.jsonl (training/saves.py) and prints one table row per mode: the
median over the saves of the loop's blocking time and of the time until the checkpoint was
complete, and the median step time (all medians). The first save of each run is left out
(it allocates the staging memory). Text: a few standard-library packages, tokenized on the
fly.
"""

from __future__ import annotations

import json
import shlex
import shutil
import statistics
import sys
import sysconfig
from pathlib import Path

from scaletrain.bench.runner import Say, run_logged
from scaletrain.config import load_config, split_args
from scaletrain.errors import UserError

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS = ",".join(str(STDLIB / d / "*.py") for d in ("json", "email", "collections", "asyncio", "concurrent/futures"))
# The config before the caller's words (which override it).
DEFAULTS = [
    "model.preset=small",
    f"data.paths=[{CORPUS}]",
    "train.steps=30",
    "train.log_every=5",
    "checkpoint.every=5",
    "checkpoint.keep=2",
]
MODES = ("false", "true")  # checkpoint.async_save


def commands(words: list[str], out: Path, nproc: int) -> list[tuple[str, Path, list[str]]]:
    """(async_save, run directory, command) of each run: the same config in both modes."""
    runs = []
    for mode in MODES:
        run_dir = out / f"async_{mode}"
        overrides = [*DEFAULTS, *words, f"run.dir={run_dir}", f"checkpoint.async_save={mode}", "train.resume=never"]
        cmd = [sys.executable, "-m", "scaletrain"]
        cmd += ["train", *overrides] if nproc == 1 else ["launch", "--nproc", str(nproc), *overrides]
        runs.append((mode, run_dir, cmd))
    return runs


def check(words: list[str], nproc: int) -> None:
    """The config both runs get, and enough saves to time: said before anything runs."""
    files, overrides = split_args([*DEFAULTS, *words])
    cfg = load_config(files, overrides)
    every, steps = cfg.checkpoint.every, cfg.train.steps
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: accepted: at least 1")
    if every < 1 or steps < 2 * every:
        raise UserError(
            f"checkpoint.every={every}, train.steps={steps}: fewer than 2 saves (the first is left out); "
            f"accepted: checkpoint.every >= 1 and train.steps >= 2 x checkpoint.every"
        )


def run_suite(words: list[str], *, out: Path, nproc: int, dry_run: bool, say: Say) -> int:
    check(words, nproc)
    runs = commands(words, out, nproc)
    if dry_run:
        for _, _, cmd in runs:
            print(shlex.join(cmd))
        return 0
    rows = []
    for i, (mode, run_dir, cmd) in enumerate(runs):
        say(f"bench: checkpoint.async_save={mode} ({i + 1}/{len(runs)})")
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time
        run_logged(cmd, out / f"async_{mode}.log", f"the checkpoint.async_save={mode} run")
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        saves = sorted((r for r in lines if r.get("event") == "checkpoint"), key=lambda r: r["step"])[1:]
        steps = [r["step_time_s"] for r in lines if "event" not in r]
        rows.append(
            (
                "async" if mode == "true" else "sync",
                len(saves),
                statistics.median(r["blocking_s"] for r in saves),
                statistics.median(r["waited_for_previous_s"] for r in saves),
                statistics.median(r["total_s"] for r in saves),
                statistics.median(steps),
            )
        )
    print("| save | saves timed | loop blocked | of which waiting for the previous save | until complete | step time |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, n, blocking, waited, total, step in rows:
        print(f"| {mode} | {n} | {blocking:.3f} s | {waited:.3f} s | {total:.3f} s | {step:.3f} s |")
    return 0
