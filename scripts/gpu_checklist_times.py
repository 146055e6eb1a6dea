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
# templates unfilled. Measured on lent H200s in two sessions (docs/gpu/2026-11-27-h200 and
# docs/gpu/2026-11-27-second/1-h200: their results.jsonl files, each `seconds`), rounded: parts 1, 2, 4
# and 5 from the first session (the second call's for the ZeRO checks: the arch-list failure had stopped
# them in seconds the first time), parts 3 and 6 from the second, which traced step 5 of each MFU run.
# oom-1b-mb64 was killed where the first session's budget ended (62 s, after its three steps, while
# saving or exiting): 80 s is that floor raised by a guess. zero1-bf16 and zero3-offload-fp16 were the
# first DeepSpeed runs of their kind in their call, so their seconds include building FusedAdam and
# DeepSpeedCPUAdam (~25-30 s); in a whole run part 2 builds them first and the two are pessimistic.
# fmt: off
GPU_S = {
    # 1: nvidia-smi; the CLI (no torch); torch and deepspeed imported, CUDA started, nvcc asked
    "nvidia-smi": 0, "scaletrain CLI": 1, "python/torch/deepspeed": 10, "DeepSpeed optimizer": 0,
    # 2: ddp, the first run, also trains the tokenizer and cuts the shards; zero2 JIT-builds FusedAdam
    # with nvcc (~60 of its 72 s), zero3-offload DeepSpeedCPUAdam with the host compiler (~45 s)
    "ddp-bf16": 16, "fsdp-bf16": 11, "zero2-bf16": 72, "zero3-bf16": 19, "zero3-offload-bf16": 59,
    # 3: the 1b preset at seq 2048: start-up, 1.24B parameters initialised, 20 steps of 16 x 2048 tokens
    # (7-14 s) with step 5 traced, the final checkpoint (15 GB); compiling adds inductor's first compile
    "plan 1b AC=false": 9, "plan 1b AC=true": 6, "MFU 1b": 0,
    "1b-eager-mb{mb}{ac_tag}": 81, "1b-compiled-mb{mb}{ac_tag}": 73, "1b-float8-compiled-mb{mb}{ac_tag}": 76,
    # 4: plan --measure: start-up, the model, 3 steps under MemTracker (zero3: DeepSpeed's partitioning)
    "1b-fsdp-bf16-AC-mb4": 27, "1b-fsdp-bf16-mb2": 21, "1b-zero3-bf16-AC-mb4": 49, "small-zero2-bf16": 20,
    # 5: other issues' checks. oom-1b-mb64 fails at micro-batch 64 and 32 before it trains at 16
    "moe-small-bf16": 12, "document-mask-bf16": 21, "cp-attention-kernels": 11, "oom-1b-mb64": 80,
    # issue 40's pair, not yet run: moe-small-bf16's 12 s for 4 steps of 8 experts, guessed up for 10 steps
    # of 64 (the loop: 64 matmuls and a host read per layer and forward)
    "moe-v3-grouped-bf16": 25, "moe-v3-loop-bf16": 40,
    # issue 55's pair, not yet run (ESTIMATED): the calibration's sweep is bounded at about a minute; the
    # comparison plans the ~30 recorded runs (40 s on this project's CPU, the GPU host's faster)
    "clock-calibrate": 75, "clock-gpu": 30,
    # issue 42's pair, not yet run: 10 steps of 32k tokens of the 1b preset (~6 GFLOPs/token with attention:
    # ~2 PFLOPs a step, ~4 s at 40% of an H100's bf16) after ~20 s of start-up, the offload's copies beside
    "long-1b-32k-AC": 60, "long-1b-32k-AC-host-tiles": 75,
    # 6: when time is left (fp16: 10 steps)
    "zero1-bf16": 47, "fsdp-offload-bf16": 8, "1b-eager-mb{mb}-AC": 65,
    "small-ddp-fp32": 10, "small-fsdp-bf16": 11, "small-zero3-bf16": 17,
    "ddp-fp16": 10, "fsdp-fp16": 9, "zero2-fp16": 12, "zero3-fp16": 12, "zero3-offload-fp16": 42,
}
# Checks no GPU run has timed yet (added since): their figures above are estimates.
ESTIMATED: frozenset[str] = frozenset(
    {"moe-v3-grouped-bf16", "moe-v3-loop-bf16", "long-1b-32k-AC", "long-1b-32k-AC-host-tiles", "clock-calibrate", "clock-gpu"}
)
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
