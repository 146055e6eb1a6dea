"""`scaletrain bench`: what scaletrain's loop costs against hand-written loops over the same
engines (raw.py) and against HF Trainer and Accelerate (peers.py); runner.py runs them
interleaved, report.py turns the runs into figures and docs/benchmarks.md."""

from scaletrain.bench.runner import Bench, Run, run_bench

__all__ = ["Bench", "Run", "run_bench"]
