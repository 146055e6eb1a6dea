"""How long the training loop stands still for a checkpoint: checkpoint.async_save=true
against false, same config, same machine. The figures in docs/checkpointing.md come from it.

    python bench/checkpoint_blocking.py --out /tmp/ckpt-bench [--nproc N] [key=value ...]

Runs `scaletrain train` (or `scaletrain launch --nproc N`) once per mode, reads the
checkpoint event rows of metrics.jsonl (saves.py) and prints one table row per mode: the
median over the saves of the loop's blocking time and of the time until the checkpoint was
complete, and the median step time (all medians). The first save of each run is left out (it allocates
the staging memory). Text: a few standard-library packages, tokenized on the fly.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS = ",".join(str(STDLIB / d / "*.py") for d in ("json", "email", "collections", "asyncio", "concurrent/futures"))
DEFAULTS = [
    "model.preset=small",
    f"data.paths=[{CORPUS}]",
    "train.steps=30",
    "train.log_every=5",
    "checkpoint.every=5",
    "checkpoint.keep=2",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="directory for the two runs")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("overrides", nargs="*", help="config overrides, after the defaults: " + " ".join(DEFAULTS[:1]))
    args = p.parse_args()
    rows = []
    for mode in ("false", "true"):
        run_dir = args.out / f"async_{mode}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time
        overrides = [*DEFAULTS, *args.overrides, f"run.dir={run_dir}", f"checkpoint.async_save={mode}", "train.resume=never"]
        cmd = [sys.executable, "-m", "scaletrain"]
        cmd += ["train", *overrides] if args.nproc == 1 else ["launch", "--nproc", str(args.nproc), *overrides]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
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


if __name__ == "__main__":
    sys.exit(main())
