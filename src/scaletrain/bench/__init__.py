"""`scaletrain bench`, three suites:

- loops (the default): what scaletrain's loop costs against hand-written loops over the
  same engines (raw.py) and against HF Trainer and Accelerate (peers.py); runner.py runs
  them interleaved, report.py turns the runs into figures and docs/benchmarks.md, loops.py
  is the suite from request to table.
- checkpoint (checkpoint_blocking.py): how long a checkpoint stops the loop, synchronous
  against background writes (docs/checkpointing.md).
- telemetry (telemetry_overhead.py): what telemetry and the guards cost a step
  (docs/telemetry.md).

The CLI (scaletrain.cli.bench) imports a suite's module only when it runs that suite; this
package's own top level stays light: raw.py and peers.py are the entry points of separate
torchrun processes.
"""

from scaletrain.bench.runner import Bench, Run, run_bench

__all__ = ["Bench", "Run", "run_bench"]
