"""Token shards read from an S3 server on loopback against the same shards on local disk
(docs/data.md): the loader's read throughput, and the training step time with each.

    .venv/bin/python scripts/s3_throughput.py [--data DIR] [--steps 20]

Needs the test extras (moto's S3 server, s3fs). Prepares the embedded corpus (or takes a
prepared --data), copies it to a fresh bucket, then
  1. reads --windows random windows of 2,049 tokens as one rank does (RankBatches at world
     8, rank 3), from disk and from s3:// with a cold cache of the default size, and prints
     MB/s of tokens delivered (and MB fetched from the store);
  2. trains the `small` preset for --steps steps of 2 x 2048 tokens reading each, twice
     each, interleaved, and prints the median step time of steps 5 onward of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from s3_server import start_server, with_bucket  # noqa: E402  # the tests' loopback server
from scaletrain.data.loader import PackedTokens, RankBatches  # noqa: E402
from scaletrain.data.remote import StoreOptions  # noqa: E402


def read_rate(data: PackedTokens, windows: int) -> float:
    """MB/s of tokens one rank's steps deliver (4 windows a step, rank 3 of 8), the
    read-ahead of each next step included; timed after one step (imports, the manifest)."""
    batches = RankBatches(data, 4, 1, dp_rank=3, dp_size=8)
    batches.next_step()
    start, done = time.perf_counter(), 0
    while done < windows:
        batches.next_step()
        done += 4
    return done * (data.seq_len + 1) * data.dtype.itemsize / (time.perf_counter() - start) / 1e6


def step_time(args: list[str], env: dict[str, str]) -> float:
    subprocess.run([sys.executable, "-m", "scaletrain", "train", *args], env=env, check=True, capture_output=True)
    run = Path(next(a.split("=", 1)[1] for a in args if a.startswith("run.dir=")))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    return statistics.median(r["step_time_s"] for r in steps[4:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, help="a prepared directory (default: the embedded corpus, prepared here)")
    ap.add_argument("--windows", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = a.data
        if data is None:
            data = root / "data"
            subprocess.run([sys.executable, "-m", "scaletrain", "data", "prepare", "--input", *_corpus(), "--out", str(data)],
                           check=True, capture_output=True)  # fmt: skip
        s3 = with_bucket(start_server(), "throughput")
        url = s3.upload(data, "data")
        os.environ.update(s3.env)
        local = PackedTokens(data, 2048, seed=0)
        remote = PackedTokens(url, 2048, seed=0, store=StoreOptions(local_dir=root / "tok"))
        print(f"read, local disk: {read_rate(local, a.windows):.1f} MB/s")
        print(f"read, s3 on loopback: {read_rate(remote, a.windows):.1f} MB/s "
              f"({remote.remote.cache.fetched * remote.manifest['block_bytes'] / 1e6:.1f} MB fetched)")  # fmt: skip
        common = ["model.preset=small", "data.seq_len=2048", "train.micro_batch=2", f"train.steps={a.steps}", "train.log_every=1",
                  "eval.every=0", "run.device=cpu", "checkpoint.every=0", f"data.dir={root / 'cache'}"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        # Interleaved, disk s3 disk s3: this machine's speed drifts between runs.
        times: dict[str, list[float]] = {"disk": [], "s3": []}
        for i, (name, path) in enumerate([("disk", data), ("s3", url)] * 2):
            times[name].append(step_time([*common, f"data.paths={path}", f"run.dir={root / f'run{i}'}"], env))
        disk, store = (statistics.mean(times[k]) for k in ("disk", "s3"))
        print(f"small preset, median step time per run: local disk {times['disk']}, s3 {times['s3']}; "
              f"means {disk:.3f} s and {store:.3f} s ({100 * (store / disk - 1):+.1f}%)")  # fmt: skip
        s3.server.stop()


def _corpus() -> list[str]:
    from scaletrain.data.sources import default_corpus_globs

    return default_corpus_globs()


if __name__ == "__main__":
    main()
