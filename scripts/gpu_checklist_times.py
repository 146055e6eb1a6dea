"""How long each check of scripts/gpu_checklist.py takes: what `--budget` plans with and `--list` prints.

    python scripts/gpu_checklist_times.py OUT_DIR/results.jsonl   # a run's measured seconds, as a GPU_S table

GPU_S holds what a GPU run measured (SOURCE says where and when), and estimates for the checks no
GPU run has timed yet (ESTIMATED): after a run, replace its figures with the table this prints from
its results.jsonl (each result row holds the seconds from its check's start to its result line).
CPU_S, the CPU stand-ins, was measured on this project's 2-core machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SOURCE = "H200, 2026-11-27"  # where GPU_S was measured; "estimate" while none of it was
# The checklist's own cost per check, the same on any machine: its result line, results.jsonl appended,
# summary.md and logs.tar.gz rewritten (a run's checkpoint is removed inside its own seconds).
OVERHEAD_S = 0.5
RESERVE_S = 5.0  # left at the end of a budget: the last summary, the way out
UNKNOWN_S = 30.0  # a check missing from the tables (one added since they were measured)

# Seconds on one GPU (16 cores), check by check, from its start to its result line; names as in CHECKS,
# templates unfilled. Measured on the lent H200 (docs/gpu/2026-11-27-h200: its results.jsonl files, each
# `seconds`), the first run's for what passed there and the second's for the ZeRO checks (DeepSpeed's
# arch-list failure had stopped them in seconds the first time), rounded up. Two were killed where the
# budget ended, so their figure is a floor raised by a guess: oom-1b-mb64 (62 s when it was killed after
# its three steps, while saving or exiting) and zero1-bf16 (16 s, also after its steps). The MFU runs get
# 3 s for the trace of step 5, added since. ESTIMATED names what no GPU run has timed yet.
# fmt: off
GPU_S = {
    # 1: nvidia-smi; the CLI (no torch); torch and deepspeed imported, CUDA started, nvcc asked
    "nvidia-smi": 0, "scaletrain CLI": 1, "python/torch/deepspeed": 9, "DeepSpeed optimizer": 0,
    # 2: ddp, the first run, also trains the tokenizer and cuts the shards; zero2 JIT-builds FusedAdam
    # with nvcc (~60 of its 72 s), zero3-offload DeepSpeedCPUAdam with the host compiler (~45 s)
    "ddp-bf16": 16, "fsdp-bf16": 11, "zero2-bf16": 72, "zero3-bf16": 19, "zero3-offload-bf16": 59,
    # 3: the 1b preset at seq 2048: start-up, 1.24B parameters initialised, 20 steps of 16 x 2048 tokens
    # (11-14 s), the final checkpoint (15 GB); compiling adds inductor's first compile, float8 more
    "plan 1b AC=false": 10, "plan 1b AC=true": 6, "MFU 1b": 0,
    "1b-eager-mb{mb}{ac_tag}": 74, "1b-compiled-mb{mb}{ac_tag}": 79, "1b-float8-compiled-mb{mb}{ac_tag}": 87,
    # 4: plan --measure: start-up, the model, 3 steps under MemTracker (zero3: DeepSpeed's partitioning)
    "1b-fsdp-bf16-AC-mb4": 27, "1b-fsdp-bf16-mb2": 21, "1b-zero3-bf16-AC-mb4": 49, "small-zero2-bf16": 20,
    # 5: other issues' checks. oom-1b-mb64 fails at micro-batch 64 and 32 before it trains at 16
    "moe-small-bf16": 12, "document-mask-bf16": 21, "cp-attention-kernels": 11, "oom-1b-mb64": 80,
    # 6: when time is left (fp16: 10 steps)
    "zero1-bf16": 20, "fsdp-offload-bf16": 14, "1b-eager-mb{mb}-AC": 80,
    "small-ddp-fp32": 10, "small-fsdp-bf16": 10, "small-zero3-bf16": 20,
    "ddp-fp16": 10, "fsdp-fp16": 11, "zero2-fp16": 14, "zero3-fp16": 20, "zero3-offload-fp16": 16,
}
# Part 6's, but for zero1's floor: estimates from the measured neighbours (the planner's small configs as
# small-zero2's 20 s less its DeepSpeed, the AC run as the eager one plus its recompute, fp16 as bf16).
ESTIMATED = frozenset({"fsdp-offload-bf16", "1b-eager-mb{mb}-AC", "small-ddp-fp32", "small-fsdp-bf16", "small-zero3-bf16",
                       "ddp-fp16", "fsdp-fp16", "zero2-fp16", "zero3-fp16", "zero3-offload-fp16"})
# The CPU stand-ins, measured (docs/gpu.md's transcript: 2 cores, torch 2.13.0+cpu, 10 steps each).
CPU_S = {"nvidia-smi": 0, "scaletrain CLI": 1, "python/torch/deepspeed": 2,
         "ddp-cpu": 4, "fsdp-cpu": 4, "zero2-cpu": 5, "tiny-ddp-cpu": 3, "tiny-zero2-cpu": 5}
# fmt: on


def expected(name: str, cuda: bool) -> float:
    """What a check is planned to take, the checklist's overhead included."""
    table = GPU_S if cuda else CPU_S
    return table.get(name, UNKNOWN_S) + OVERHEAD_S


def label(name: str, cuda: bool) -> str:
    """Where a figure comes from, for --list."""
    table = GPU_S if cuda else CPU_S
    if name not in table:
        return "unknown"
    return ("estimate" if SOURCE == "estimate" or name in ESTIMATED else "measured") if cuda else "measured, CPU"


def measured(path: str) -> dict[str, float]:
    """A run's seconds per check, by the name CHECKS gives it (a retried check: its attempts added)."""
    seconds: dict[str, float] = {}
    for row in map(json.loads, Path(path).read_text().splitlines()):
        if row.get("status") != "SKIP" and "seconds" in row:
            key = row.get("check", row["name"])
            seconds[key] = seconds.get(key, 0) + row["seconds"]
    return seconds


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("GPU_S = {")
    print("\n".join(f"    {name!r}: {round(s)}," for name, s in measured(sys.argv[1]).items()))
    print("}")
