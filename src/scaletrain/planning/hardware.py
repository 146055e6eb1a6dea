"""Devices the planner knows, memory sizes as people write them, and a measured CPU peak."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from scaletrain import disk_cache
from scaletrain.errors import UserError

GiB = 1024**3


@dataclass(frozen=True)
class Device:
    name: str
    memory: float  # bytes per device
    peak_flops_16: float  # dense bf16/fp16 FLOP/s
    peak_flops_32: float  # dense fp32 FLOP/s (no TF32)
    intra_node_bw: float  # bytes/s per device within a node (NVLink / shared memory)
    inter_node_bw: float  # bytes/s per device across nodes (InfiniBand / Ethernet)
    host_bw: float  # bytes/s device <-> host (offload traffic)
    # Start-up cost of one small collective: what tensor parallel's many per-block
    # reductions pay besides their bytes. NCCL within a node: ~20 us; gloo on a loaded
    # CPU: milliseconds (docs/parallelism.md: tp 2 halved the tiny model's throughput).
    collective_latency: float = 20e-6
    # Dense float8 FLOP/s (e4m3/e5m2 tensor cores: train.float8); 0: none (A100, a CPU).
    peak_flops_8: float = 0.0
    # Device memory bandwidth (bytes/s): what float8's casts of activations and weights,
    # memory-bound kernels, cost (planning/float8.py); 0: unknown, not counted.
    memory_bw: float = 0.0
    # The kind the clock's rates are kept for (planning/clock/rates.py): a KNOWN_GPUS key, or "cpu".
    kind: str = ""


# Vendor datasheet figures (dense, no sparsity). Inter-node: one 400 Gb/s NIC per GPU
# (H100/H200), 200 Gb/s (A100). Host link: PCIe Gen5 x16 ~ 55 GB/s usable, Gen4 ~ 25.
# Float8 (NVIDIA H100, H200 and L40S datasheets, which quote it with sparsity: dense is half):
# H100 SXM and H200 3,958 -> 1,979 TFLOP/s, H100 PCIe 3,026 -> 1,513, L40S 1,466 -> 733;
# the A100 has none. Memory bandwidth: H100 SXM 3.35 TB/s, PCIe 2.0, H200 4.8, A100 80GB
# 2.039, 40GB 1.555, L40S 0.864.
_DATASHEETS = {
    "h100": Device("H100 SXM", 80 * GiB, 989e12, 67e12, 450e9, 50e9, 55e9, peak_flops_8=1979e12, memory_bw=3.35e12),
    "h100-pcie": Device("H100 PCIe", 80 * GiB, 756e12, 51e12, 64e9, 25e9, 55e9, peak_flops_8=1513e12, memory_bw=2.0e12),
    "h200": Device("H200", 141 * GiB, 989e12, 67e12, 450e9, 50e9, 55e9, peak_flops_8=1979e12, memory_bw=4.8e12),
    "a100": Device("A100 SXM", 80 * GiB, 312e12, 19.5e12, 300e9, 25e9, 25e9, memory_bw=2.039e12),
    "a100-40gb": Device("A100 SXM 40GB", 40 * GiB, 312e12, 19.5e12, 300e9, 25e9, 25e9, memory_bw=1.555e12),
    "l40s": Device("L40S", 48 * GiB, 362e12, 91.6e12, 32e9, 25e9, 25e9, peak_flops_8=733e12, memory_bw=0.864e12),
}
KNOWN_GPUS = {key: replace(d, kind=key) for key, d in _DATASHEETS.items()}


def gpu_kind(name: str) -> str:
    """The KNOWN_GPUS kind of a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100"), or the
    name made a key ("nvidia-rtx-6000") for a GPU without one."""
    low = name.lower()
    for kind in ("h200", "l40s"):
        if kind in low:
            return kind
    if "h100" in low:
        return "h100-pcie" if "pcie" in low else "h100"
    if "a100" in low:
        return "a100-40gb" if "40gb" in low else "a100"
    return re.sub(r"[^a-z0-9]+", "-", low).strip("-")


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGTP]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "m": 1e6,
    "g": 1e9,
    "t": 1e12,
    "p": 1e15,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "pi": 2**50,
}


def parse_size(text: str, what: str) -> float:
    """'80GiB', '80 GB', '1TiB', '512MiB' -> bytes (GB = 1e9, GiB = 2**30)."""
    m = _SIZE.match(str(text))
    if not m:
        raise UserError(f"{what} {text!r} is not a size; accepted: a number with a unit such as 80GiB, 40GB, 1TiB")
    unit = (m.group(2) or "").lower().removesuffix("b")
    return float(m.group(1)) * _UNITS[unit]


def gpu(name: str | None, memory: str | None) -> Device:
    """A known GPU by name, optionally with another memory size; or an H100-class default."""
    if name is not None and name.lower() not in KNOWN_GPUS:
        raise UserError(f"--gpu {name!r} is unknown; accepted: {', '.join(KNOWN_GPUS)}")
    device = KNOWN_GPUS[(name or "h100").lower()]
    return replace(device, memory=parse_size(memory, "--gpu-memory")) if memory else device


@lru_cache(maxsize=1)
def measured_cpu_peak() -> float:
    """fp32 matmul FLOP/s of this process's threads: the CPU's 'peak' is what it does.
    Measured once per machine, thread count, kernel family and torch (0.1-0.2 s of a
    core, which every rank of every run paid), then kept (disk_cache.py); with
    SCALETRAIN_CACHE=off, or where the CPU cannot be identified, in every process."""
    from scaletrain.planning.clock import contention

    cpu = disk_cache.cpu_identity()
    if cpu is None:
        return _matmul_rate()
    threads = torch.get_num_threads()
    key = ["cpu-peak", *cpu, torch.__version__, threads, os.environ.get("ATEN_CPU_CAPABILITY", "")]
    # Kept with whether the machine was busy, as the clock's replays: a peak measured beside
    # other work was a fraction of the CPU's (a 2-thread peak kept at 60 GFLOP/s where the
    # quiet machine does 149; every later run's MFU read 150% against it).
    return float(contention.kept(PEAK_FILE, key, threads, _matmul_rate, "flops")["flops"])


PEAK_FILE = "cpu-peak"


def _matmul_rate() -> float:
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):  # wake the thread pool: the first calls run at a fraction of speed
        a @ b
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def this_cpu(memory: float | None = None) -> Device:
    total = memory or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    peak = measured_cpu_peak()
    # gloo over loopback / shared memory: a few GB/s is what it sustains here.
    return Device("CPU (measured)", total, peak, peak, 2e9, 1e9, 10e9, collective_latency=2e-3, kind="cpu")


def is_host(device: Device) -> bool:
    """Whether `device` is this machine's CPU (this_cpu), whose memory is the host's."""
    return device.name.startswith("CPU")


def fmt(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB / 10 else f"{nbytes / 2**20:.1f} MiB"
