"""What one device can do and what it holds: peak FLOP/s for MFU, memory, utilisation."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Any

import torch

from scaletrain.planning.hardware import KNOWN_GPUS, measured_cpu_peak


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    peak_flops: float | None  # per device, at the run's precision; None: unknown (no MFU)
    peak_source: str  # where the figure comes from, for run.json and the docs
    memory_bytes: float  # device memory, or host RAM on CPU


def _known_gpu(name: str) -> str | None:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; PCIe and 40 GB parts by their own entries."""
    n = name.lower().replace("-", " ")
    for key in sorted(KNOWN_GPUS, key=len, reverse=True):  # 'h100-pcie' before 'h100'
        model, _, variant = key.partition("-")
        if model in n.split() and (not variant or variant.replace("gb", "") in n):
            return key
    return None


def device_info(device: torch.device, precision: str, peak_tflops: float | None) -> DeviceInfo:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        key = _known_gpu(props.name)
        if peak_tflops:
            peak, source = peak_tflops * 1e12, "telemetry.peak_tflops"
        elif key:
            known = KNOWN_GPUS[key]
            # fp32 matmuls run on TF32 tensor cores when allowed; otherwise the fp32 peak.
            tf32 = torch.backends.cuda.matmul.allow_tf32
            peak = known.peak_flops_16 if precision != "fp32" else (known.peak_flops_16 / 2 if tf32 else known.peak_flops_32)
            source = f"datasheet {known.name} dense {'bf16/fp16' if precision != 'fp32' else ('tf32' if tf32 else 'fp32')}"
        else:
            peak, source = None, f"unknown GPU {props.name!r}: set telemetry.peak_tflops for MFU"
        return DeviceInfo(props.name, peak, source, float(props.total_memory))
    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if peak_tflops:
        return DeviceInfo("CPU", peak_tflops * 1e12, "telemetry.peak_tflops", ram)
    # A CPU's 'peak' is what an fp32 matmul reaches in this process (beside the other ranks).
    return DeviceInfo("CPU", measured_cpu_peak(), "measured fp32 matmul (once per machine and thread count)", ram)


def memory_peak(device: torch.device) -> tuple[int, int | None]:
    """(peak, reserved) bytes since the last call: CUDA max allocated / max reserved, reset
    each call; on CPU the process's peak RSS (the kernel keeps no resettable peak, so it is
    the peak of the process so far) and no reserved figure."""
    if device.type == "cuda":
        peak, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak, reserved
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None


def gpu_utilisation(device: torch.device) -> float | None:
    """NVML's utilisation (%) of this GPU over its last sample period; None without NVML."""
    if device.type != "cuda":
        return None
    try:
        return float(torch.cuda.utilization(device))
    except Exception:  # no NVML library, or a driver that does not expose it: not an error
        return None


def as_json(info: DeviceInfo) -> dict[str, Any]:
    return {
        "device_name": info.name,
        "peak_flops": info.peak_flops,
        "peak_flops_source": info.peak_source,
        "device_memory_bytes": info.memory_bytes,
    }
