"""What tests/test_gpu_checklist*.py share: scripts/gpu_checklist.py's checks in the issue's order,
the script loaded as a module, and its results read back."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_checklist.py"
KNOBS = ("STEP_TIMEOUT", "ENGINE_STEPS", "MFU_STEPS", "MFU_MAX_MB", "DS_OPTIMIZER", "KEEP_CHECKPOINTS", "FORCE_CPU")
ST = f"{sys.executable} -m scaletrain"  # how the checklist starts the CLI: this interpreter
# The order on a GPU, part by part.
ENV = ("nvidia-smi", "scaletrain CLI", "python/torch/deepspeed", "DeepSpeed optimizer")  # part 1
FIVE = ("ddp", "fsdp", "zero2", "zero3", "zero3-offload")  # part 2 in bf16; part 6 in fp16
MB = ("plan 1b AC=false", "plan 1b AC=true", "MFU 1b")  # part 3: the micro-batch the planner allows
RUNS_1B = ("1b-eager-mb{mb}{ac_tag}", "1b-compiled-mb{mb}{ac_tag}", "1b-float8-compiled-mb{mb}{ac_tag}")  # part 3
PLANNER = ("1b-fsdp-bf16-AC-mb4", "1b-fsdp-bf16-mb2", "1b-zero3-bf16-AC-mb4", "small-zero2-bf16")  # part 4
# part 5: issues 55, 27, 28, 29, 26, 40, 42
MORE = (
    "clock-calibrate",
    "clock-gpu",
    "moe-small-bf16",
    "document-mask-bf16",
    "cp-attention-kernels",
    "oom-1b-mb64",
    "moe-v3-grouped-bf16",
    "moe-v3-loop-bf16",
    "long-1b-32k-AC",
    "long-1b-32k-AC-host-tiles",
)
LEFT = ("zero1-bf16", "fsdp-offload-bf16", "1b-eager-mb{mb}-AC", "small-ddp-fp32", "small-fsdp-bf16", "small-zero3-bf16")
FP16 = tuple(f"{e}-fp16" for e in FIVE)  # part 6's end
CPU_CHECKS = ("scaletrain CLI", "python/torch/deepspeed", "ddp-cpu", "fsdp-cpu", "zero2-cpu", "tiny-ddp-cpu", "tiny-zero2-cpu")
GPU_SKIPPED = "GPU parts (engines and planner on CUDA, 1b MFU)"
H100 = {
    "python": "3.11.7",
    "torch": "2.13.0",
    "torch_cuda": "12.8",
    "deepspeed": "0.19.8",
    "scaletrain": "0.1.0",
    "host": "gpu",
    "cuda_available": True,
    "device_count": 1,
    "device_name": "NVIDIA H100 80GB HBM3",
    "capability": "9.0",
    "device_memory": 85_029_158_912,
    "bf16": True,
    "nccl": "2.27.3",
}  # fmt: skip  (no nvcc)
CLEAN = {"step": 0, "flush": 1, "sites": {}}  # a steady interval's host reads: none inside the steps, one at the flush


def filled(names, mb=8, ac_tag=""):
    return [n.format(mb=mb, ac_tag=ac_tag) for n in names]


def load_checklist(monkeypatch):
    """The script as a module, its knobs at their defaults."""
    for knob in KNOBS:
        monkeypatch.delenv(knob, raising=False)
    spec = importlib.util.spec_from_file_location("gpu_checklist", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_checklist", module)  # where dataclasses look for the module's names
    spec.loader.exec_module(module)
    return module


def results(out: Path) -> dict[str, dict]:
    return {r["name"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


def slug(name: str) -> str:
    """A check's name as its log file names it."""
    return name.replace(" ", "-").replace("/", "-")
