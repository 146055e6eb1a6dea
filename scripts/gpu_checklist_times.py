"""How long each check of scripts/gpu_checklist.py takes: what `--budget` plans with and `--list` prints.

    python scripts/gpu_checklist_times.py OUT_DIR/results.jsonl   # a run's measured seconds, as a GPU_S table

GPU_S holds ESTIMATES until a GPU run has measured them: made without a GPU (docs/gpu.md says how),
to be replaced by the table this prints from the first GPU run's results.jsonl (each result row
holds the seconds from its check's start to its result line), with SOURCE set to where and when.
CPU_S, the CPU stand-ins, was measured on this project's 2-core machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SOURCE = "estimate"  # "estimate" until a GPU run measured GPU_S; then e.g. "H100 80GB, 2026-12-01"
# The checklist's own cost per check, the same on any machine: its result line, results.jsonl appended,
# summary.md and logs.tar.gz rewritten (a run's checkpoint is removed inside its own seconds).
OVERHEAD_S = 0.5
RESERVE_S = 5.0  # left at the end of a budget: the last summary, the way out
UNKNOWN_S = 30.0  # a check missing from the tables (one added since they were measured)

# Seconds on one H100 (16 cores), check by check, from its start to its result line; names as in
# CHECKS, templates unfilled. ESTIMATES, central ones (each could be half or double): no GPU run has
# measured them. What they assume: a process that imports torch and scaletrain and starts CUDA takes
# 5-10 s there (DeepSpeed adds ~2 s); the small preset's 3 steps take about a second.
# fmt: off
GPU_S = {
    # 1: nvidia-smi; the CLI (no torch); torch and deepspeed imported, CUDA started, nvcc asked
    "nvidia-smi": 1, "scaletrain CLI": 2, "python/torch/deepspeed": 8, "DeepSpeed optimizer": 0,
    # 2: ddp, the first run, also trains the tokenizer and cuts the shards (8 s on 2 cores here);
    # zero2 JIT-builds FusedAdam with nvcc (two sources that include torch's headers: ~40 s),
    # zero3-offload DeepSpeedCPUAdam with the host compiler (~25 s)
    "ddp-bf16": 15, "fsdp-bf16": 10, "zero2-bf16": 50, "zero3-bf16": 12, "zero3-offload-bf16": 40,
    # 3: the 1b preset at seq 2048. A plan is start-up and a traced block; a run is start-up, 1.24B
    # parameters initialised, 20 steps of 8 x 2048 tokens (~7 s at 40% MFU) and the final checkpoint
    # (15 GB of weights and Adam state: ~10 s); compiling adds inductor's first compile of a block
    # (forward and backward: ~40 s), float8 torchao's conversion and a compile of its own
    "plan 1b AC=false": 8, "plan 1b AC=true": 6, "MFU 1b": 0,
    "1b-eager-mb{mb}{ac_tag}": 30, "1b-compiled-mb{mb}{ac_tag}": 70, "1b-float8-compiled-mb{mb}{ac_tag}": 80,
    # 4: plan --measure: start-up, the model, 3 steps under MemTracker (zero3: DeepSpeed's partitioning)
    "1b-fsdp-bf16-AC-mb4": 25, "1b-fsdp-bf16-mb2": 25, "1b-zero3-bf16-AC-mb4": 35, "small-zero2-bf16": 10,
    # 5: other issues' checks, 3 steps where they train. FlexAttention compiles its kernel; oom-1b-mb64
    # fails at micro-batch 64, 32 and 16 before it trains at 8 (8 micro-batches a step)
    "moe-small-bf16": 12, "document-mask-bf16": 30, "cp-attention-kernels": 10, "oom-1b-mb64": 35,
    # 6: when time is left (fp16: 10 steps)
    "zero1-bf16": 12, "fsdp-offload-bf16": 14, "1b-eager-mb{mb}-AC": 35,
    "small-ddp-fp32": 10, "small-fsdp-bf16": 10, "small-zero3-bf16": 12,
    "ddp-fp16": 10, "fsdp-fp16": 11, "zero2-fp16": 13, "zero3-fp16": 14, "zero3-offload-fp16": 16,
}
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
    return ("estimate" if SOURCE == "estimate" else "measured") if cuda else "measured, CPU"


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
