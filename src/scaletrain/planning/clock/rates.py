"""What each operation costs on a device kind: the clock's rates, measured, never fitted.

Three sources, in the order the clock takes them (`rates_for`):

- this machine's CPU (the device a CPU plan trains on): every traced call is replayed for
  real at its exact shapes and timed (clock/replay.py), once per machine, thread count,
  kernel family and torch, then kept (disk_cache.py, as the CPU's matmul rate always was);
  the host's cost per dispatched operation and the collectives over gloo come from
  `scaletrain plan --calibrate` (clock/calibrate.py), or, uncalibrated, from stated
  assumptions that the plan names.
- a GPU kind's committed table (clock/tables/<kind>.json), written by `scaletrain plan
  --calibrate` on such a GPU (the device command runs it): matmul times at the shapes it
  swept, attention times by length and head size, memory bandwidth by transfer size, the
  host's cost per operation, the optimizer's rate and, on more than one device, each
  collective's latency and bus bandwidth.
- a GPU kind nobody measured: the datasheet's peaks times the stated factors below, said
  in the plan's output.

A table measured with another torch, or on another device than its name, is used with a
line saying so; nothing is solved backwards from a training run.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from scaletrain import disk_cache
from scaletrain.planning.clock.cpu_measured import (
    _measured_optimizer,
    _replayed,
    cpu_bandwidth,
    cpu_host_op,
    cpu_in_sequence,
    cpu_key,
)
from scaletrain.planning.clock.trace import Call, matmul_layout
from scaletrain.planning.hardware import Device, is_host, measured_cpu_peak

TABLES = Path(__file__).parent / "tables"
KERNEL_MARGIN = 0.05  # train.attention_kernel=auto takes cuDNN's attention where that much faster (training/attention_kernel.py)
# A CPU call past these is priced at the CPU's measured matmul rate or copy bandwidth, not
# replayed: a second or more of one core each (a 70B block's matmuls at 16k tokens).
REPLAY_FLOPS = 2e10
REPLAY_BYTES = 1 << 28

# Datasheet fallback (a GPU kind with no table): the share of each peak a kernel reaches.
# Matmuls: cuBLAS's bf16 GEMMs at transformer shapes ran at 72% of the H100's and H200's
# dense peak in the profiled 1b steps of docs/gpu.md ("Device time by kind of kernel":
# 716 and 714 TFLOP/s of matmul kernels); attention: 2.4x the FLOPs the causal kernel runs
# per second in the same profiles... counted here as the kernel's own FLOPs: 26% of peak;
# memory-bound kernels: 80% of the datasheet bandwidth (a large copy's share on HBM3);
# host: 12 us per dispatched operation of an eager training step (PyTorch's eager
# overhead per op, forward with autograd and backward, on a server CPU).
DATASHEET_MATMUL = 0.72
DATASHEET_ATTENTION = 0.26
DATASHEET_MEMORY = 0.80
DATASHEET_HOST_OP = 12e-6
DATASHEET_HOST_OP_TP = 60e-6  # DTensor's Python dispatch: 8-9x the plain cost, as measured on this project's CPU
DATASHEET_LAUNCH = 3e-6  # the shortest kernel a GPU runs, start to end
# Collectives where none were measured: NCCL's ring over NVLink or the network reaches
# about 80% of the link's bandwidth at large sizes, after a start-up of `collective_latency`.
DATASHEET_BUS = 0.80
RINGS = ("all_reduce", "all_gather", "reduce_scatter")  # NCCL runs these as rings
# Under tensor parallel where `--calibrate` has not measured it: this project's 2-core CPU
# measured 72 us per traced operation of the tiny block split over a mesh of one (docs/planner.md).
CPU_HOST_OP_TP = 72e-6
# gloo on this machine's loopback where `--calibrate` has not measured it: the start-up of
# one collective and the bytes per second of its ring (an all-reduce between a pair of
# gloo processes on this project's 2-core CPU measured 0.9 ms and 0.86 GB/s: docs/planner.md).
GLOO_LATENCY = 0.9e-3
GLOO_BANDWIDTH = 0.86e9


@dataclass
class Rates:
    """The clock's prices on one device kind (module docstring)."""

    kind: str  # "cpu", "h100", ...
    source: str  # one phrase: where the rates come from, for the plan's output
    asynchronous: bool  # a GPU: the host queues kernels ahead; a CPU runs each op as it is dispatched
    host_op: float  # host seconds per dispatched aten operation in a training pass (autograd included)
    host_op_tp: float  # the same under tensor parallel, each operation dispatched through DTensor
    launch: float  # device seconds of the shortest kernel
    memory_bw: float  # bytes/s of a large memory-bound kernel
    notes: list[str] = field(default_factory=list)  # what was assumed, one line each
    _table: dict[str, Any] = field(default_factory=dict)
    _device: Device | None = None
    _threads: int = 1
    # A CPU: its operations one after another in a pass against each replayed alone (measure.in_sequence).
    _sequence: float = 1.0
    # A CPU run of several ranks: their compute in step (each pass as long as the slowest rank's)
    # against one alone (calibrate.py _in_step, with the calibration's ranks); host_op is
    # scaled by it too, and host_op_tp where it was measured on a mesh of one, not in step.
    _side: float = 1.0

    def has_attention(self, kernel: str) -> bool:
        """Whether this GPU's table measured `kernel`'s attention (flash: the main rows; cudnn)."""
        entries = self._table.get("attention", {})
        return bool(entries.get("forward") if kernel == "flash" else (entries.get(kernel) or {}).get("forward"))

    @property
    def measured(self) -> bool:
        """Priced from a measured table (a GPU kind's committed one, or this CPU's replays)."""
        return bool(self._table) or self.kind == "cpu"

    # -- compute ------------------------------------------------------------------
    def call(self, c: Call, length: int | None = None, kernel: str = "auto") -> float:
        """Device seconds of one call; `length`: an attention call's sequence as it runs where
        it was traced shorter and scaled (its rate at that length: clock/compute.py); `kernel`:
        train.attention_kernel (auto: the faster measured; flash or cudnn: that one's rows)."""
        if self.kind == "cpu":
            if c.flops > REPLAY_FLOPS or c.nbytes > REPLAY_BYTES:
                # Too large to time here in passing: this CPU's measured matmul rate or bandwidth.
                return (c.flops / measured_cpu_peak() if c.flops else c.nbytes / self.memory_bw) * self._side
            return _replayed(c.op, c.args, self._threads) * self._sequence * self._side
        if c.kind == "matmul":
            return max(self.launch, c.flops / self._matmul_rate(c))
        if c.kind == "attention":
            return max(self.launch, c.flops / self._attention_rate(c, length, kernel))
        return self.launch + c.nbytes / self._bandwidth(c.nbytes)

    def fused(self, nbytes: float, kernels: int) -> float:
        """Device seconds of `kernels` fused memory-bound kernels moving `nbytes` in all."""
        per = nbytes / max(1, kernels)
        return kernels * self.launch + nbytes / self._bandwidth(per)

    def copy(self, nbytes: float) -> float:
        """One memory-bound pass over `nbytes` (read and write counted): engines' copies and casts."""
        if nbytes <= 0:
            return 0.0
        return self.launch + nbytes / self._bandwidth(nbytes)

    def optimizer(self, params: float, tensors: int) -> float:
        """AdamW's step over `params` fp32 parameters in `tensors` tensors, gradient
        clipping's norm and scaling included: fused AdamW reads the weight, gradient and two
        moments and writes three (28 bytes per parameter), clipping reads the gradients
        twice and writes them once (12)."""
        if params <= 0:
            return 0.0
        if self.kind == "cpu":
            return _measured_optimizer(int(params), tensors, self._threads)
        if "optimizer_fixed_s" in self._table:  # measured at two sizes (calibrate_gpu)
            return float(self._table["optimizer_fixed_s"]) + 40.0 * params / float(self._table["optimizer_bytes_per_s"])
        # The datasheet, or a table of one small step scaled up (its fixed cost scaled with it):
        # a pass over memory at the measured bandwidth, a few launches per tensor.
        return 40.0 * params / self.memory_bw + 6 * tensors * self.launch

    def engine(self, strategy: str) -> dict[str, float]:
        """The engine's own host seconds per unit it wraps (`scaletrain plan --calibrate`'s
        probe, cli/plan_calibrate.py): {"forward_backward_s", "step_s"} or {} unmeasured."""
        return dict(self._table.get("engines", {}).get(strategy, {}))

    # -- communication --------------------------------------------------------------
    def collective(self, kind: str, nbytes: float, ranks: int, inter_node: int) -> float:
        """Seconds of one collective of `kind` (all_reduce, all_gather, reduce_scatter,
        all_to_all, send) whose full buffer is `nbytes`, over `ranks` ranks: a measured
        start-up and cost per byte (a calibrated machine: scaled from the ranks it was
        measured at by the ring's share of the buffer each rank moves), else the link's
        datasheet bandwidth at DATASHEET_BUS after `collective_latency`. `inter_node`: 0 within
        a node; across nodes, how many of the group's ranks each node holds (True: one)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        if kind == "reduce_scatter" and self.kind == "cpu":
            kind = "all_reduce"  # gloo has none: FSDP2 and DeepSpeed all-reduce the whole buffer instead
        ring = _WIRE[kind](ranks)
        measured = self._table.get("collectives", {}).get("inter" if inter_node else "intra", {}).get(kind)
        if measured:
            # The measured curve at the bytes each rank moves here, as many as at its own ranks.
            return _interpolate(measured["rows"], nbytes * ring / _WIRE[kind](float(measured.get("ranks", 2))))
        latency, bus = self._link(int(inter_node), kind in RINGS)
        return latency + ring * nbytes / bus

    def latency(self, inter_node: bool = False) -> float:
        measured = self._table.get("collectives", {}).get("inter" if inter_node else "intra", {}).get("all_to_all")
        return float(measured["rows"][0][1]) if measured else self._link(int(inter_node), False)[0]

    def _link(self, inter_node: int, ring: bool) -> tuple[float, float]:
        if self.kind == "cpu":
            return GLOO_LATENCY, GLOO_BANDWIDTH
        assert self._device is not None
        if not inter_node:
            return self._device.collective_latency, DATASHEET_BUS * self._device.intra_node_bw
        # Across nodes NCCL runs a ring collective as several rings (channels), each leaving a
        # node through its own NIC: with k of the group's ranks on each node, k NICs (one per
        # GPU, hardware.py) carry it side by side, up to what NVLink moves inside the node (nccl-tests'
        # multi-node bus bandwidth on 8 x 400 Gb/s H100 nodes: some 8 x 50 GB/s, not one NIC's 50).
        # An all-to-all or a send goes through each rank's own NIC.
        rails = inter_node if ring else 1
        bw = min(self._device.intra_node_bw, rails * self._device.inter_node_bw)
        return self._device.collective_latency, DATASHEET_BUS * bw

    def float8_note(self) -> str | None:
        """The plan's line where train.float8's products have no measured rate (this CPU replays them)."""
        if self.kind == "cpu" or any(k.startswith("float8") for k in self._table.get("matmul", {})):
            return None
        ratio = self._device.peak_flops_8 / max(1.0, self._device.peak_flops_16) if self._device else 0.0
        return f"train.float8: no float8 matmul measured for {self.kind}: priced at bf16's rate x the datasheet's float8 peak over bf16's ({ratio:.1f}x)"

    # -- GPU tables -------------------------------------------------------------------
    def _matmul_rate(self, c: Call) -> float:
        dtype = c.dtype
        # The rows of the call's operand layout where the table measured it (calibrate_gpu: bf16),
        # else the row-major rows.
        layouts = self._table.get("matmul_layout", {}).get(dtype, {})
        entries = layouts.get(matmul_layout(c.op, c.args)) if layouts else None
        entries = entries or self._table.get("matmul", {}).get(dtype)
        if entries:
            return _nearest_rate(entries, c.shape[1:4] if len(c.shape) >= 4 else (1, 1, 1))
        assert self._device is not None
        if dtype.startswith("float8"):
            # train.float8's products (torch._scaled_mm) where the table measured none: bf16's
            # rate at the shape, at the datasheet's float8 peak over bf16's (`float8_note`).
            return self._matmul_rate(replace(c, dtype="bfloat16")) * self._device.peak_flops_8 / self._device.peak_flops_16
        peak = self._device.peak_flops_32 if dtype == "float32" else self._device.peak_flops_16
        return DATASHEET_MATMUL * peak * _size_efficiency(c)

    def _attention_rate(self, c: Call, length: int | None = None, kernel: str = "auto") -> float:
        entries = self._table.get("attention", {})
        direction = "backward" if "backward" in c.op else "forward"
        rows = entries.get(direction)
        bh, tq, tk, d, causal = c.shape
        tq = length or tq
        if rows and "heads" not in entries:
            # The first table measured 2^16 / length heads: below 1e11 FLOPs a call the kernel's
            # launch, not its rate (2048 tokens: 112-145 TFLOP/s, where the 1b preset's profile ran
            # FlashAttention at ~26% of the peak): only lengths measured at such work, within 2x.
            rows = [r for r in rows if 2.0 * 65536 * r[0] * r[1] >= 1e11]
            if not rows or tq <= max(r[0] for r in rows):
                rows = [r for r in rows if 0.5 <= r[0] / max(tq, 1) <= 2]
        # Past the longest length measured, the longest's rate (nearest in log space): a
        # FlashAttention kernel's rate does not fall with the length (each tile's work grows, the
        # launch and the last wave's share shrink), so that rate is a floor, not a guess upward.
        if rows:
            rate = _nearest_rate(rows, (tq, d))
            cudnn = entries.get("cudnn") or {}
            if kernel == "cudnn" and cudnn.get(direction):
                return _nearest_rate(cudnn[direction], (tq, d))
            if kernel == "auto" and cudnn.get("forward") and cudnn.get("backward") and entries.get("backward"):
                # train.attention_kernel=auto runs cuDNN's kernel where its forward and backward beat
                # FlashAttention's by its margin (training/attention_kernel.py): priced as it chooses.
                def step(e: dict[str, Any]) -> float:  # seconds per causal forward FLOP, forward and backward
                    return 1 / _nearest_rate(e["forward"], (tq, d)) + 2.5 / _nearest_rate(e["backward"], (tq, d))

                if step(cudnn) < (1 - KERNEL_MARGIN) * step(entries):
                    rate = _nearest_rate(cudnn[direction], (tq, d))
            return rate
        assert self._device is not None
        return DATASHEET_ATTENTION * self._device.peak_flops_16

    def _bandwidth(self, nbytes: float) -> float:
        curve = self._table.get("bandwidth")
        if curve:
            sizes, rates = zip(*sorted((float(s), float(r)) for s, r in curve))
            i = bisect.bisect_left(sizes, nbytes)
            return rates[min(i, len(rates) - 1)]
        return self.memory_bw


# The share of a collective's full buffer each rank sends over a ring of n ranks.
_WIRE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
}


def _interpolate(rows: list[list[float]], x: float) -> float:
    """Seconds at `x` bytes on a measured [bytes, seconds] curve: linear between its points,
    the first point's below it, the last segment's cost per byte past it."""
    if x <= rows[0][0]:
        return float(rows[0][1])
    for (x0, y0), (x1, y1) in zip(rows, rows[1:]):
        if x <= x1:
            return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    (x0, y0), (x1, y1) = rows[-2], rows[-1]
    return float(y1 + (y1 - y0) / (x1 - x0) * (x - x1))


def _size_efficiency(c: Call) -> float:
    """A small matmul reaches less of the peak: its tiles fill fewer of the GPU's units.
    Each dimension below 1024 costs in proportion (a stated shape of the datasheet
    fallback, not a measurement: the calibrated table replaces it)."""
    if len(c.shape) < 4:
        return 1.0
    _, m, n, k = c.shape
    return min(1.0, m / 1024) ** 0.5 * min(1.0, n / 1024) ** 0.5 * min(1.0, k / 1024) ** 0.3


def _nearest_rate(entries: list[list[float]], key: tuple[int, ...]) -> float:
    """The rate of the measured entry nearest `key` in log space ([*key, rate] rows)."""
    best, rate = math.inf, 1.0
    for row in entries:
        d = sum(math.log(max(1, a) / max(1, b)) ** 2 for a, b in zip(row[:-1], key))
        if d < best:
            best, rate = d, row[-1]
    return rate


# -- choosing -------------------------------------------------------------------------
CALIBRATION_FILE = "clock-calibration.json"


def rates_for(device: Device, ranks_per_node: int = 1) -> Rates:
    """The rates the clock prices `device` with (module docstring): one object per device
    and rank count in a process, so that what is priced with it can be kept (compute.py)."""
    if is_host(device):
        return _cpu_rates(cpu_threads(ranks_per_node), ranks_per_node > 1)
    return _gpu_rates(device)


def cpu_threads(ranks_per_node: int) -> int:
    """The intra-op threads each rank of a CPU run has: torch's own count for one process;
    for several, OMP_NUM_THREADS, which torchrun sets to 1 where it is unset."""
    if ranks_per_node <= 1:
        return torch.get_num_threads()
    threads = os.environ.get("OMP_NUM_THREADS", "1").split(",")[0]
    return int(threads) if threads.isdigit() and int(threads) > 0 else 1


@lru_cache(maxsize=64)
def _cpu_rates(threads: int, several: bool) -> Rates:
    calibrated = calibration()
    # Ranks in step (several): each rank's work, its host's included, as slow as the slowest rank's beside the others.
    side = float(calibrated.get("side_by_side", 1.0)) if several else 1.0
    host_op = cpu_host_op(threads) * side
    host_op_tp = calibrated.get(f"host_op_tp_{threads}")
    notes = []
    in_step = calibrated.get("host_op_tp_in_step") if several and threads == 1 else None
    if in_step is not None:
        host_op_tp = in_step  # measured on the calibration's ranks in step (calibrate.py host_op_tp_in_step)
    elif host_op_tp is not None:
        host_op_tp *= side
        if several and threads == 1:  # what the in-step measurement would have priced
            notes.append(
                "this machine's calibration predates tensor parallel's measurement over ranks in step: DTensor's cost "
                "per operation priced as on a mesh of one (scaletrain plan --calibrate measures it)"
            )
    else:
        host_op_tp = CPU_HOST_OP_TP
        if several:
            notes.append(
                f"DTensor's cost per operation is not calibrated on this machine: {CPU_HOST_OP_TP * 1e6:.0f} us assumed "
                "(scaletrain plan --calibrate measures it)"
            )
    table: dict[str, Any] = {}
    links = calibrated.get("collectives")
    if links:
        table["collectives"] = {"intra": links}
    if calibrated.get("engines"):
        table["engines"] = calibrated["engines"]
    elif several:
        notes.append(
            f"gloo's collectives are not calibrated on this machine: {GLOO_LATENCY * 1e3:.1f} ms and "
            f"{GLOO_BANDWIDTH / 1e9:.1f} GB/s assumed (scaletrain plan --calibrate measures them)"
        )
    if several and links and "side_by_side" not in calibrated:
        notes.append(
            "this machine's calibration predates the ranks-side-by-side measurement: each rank's compute priced as "
            "if it ran alone (scaletrain plan --calibrate measures it)"
        )
    beside = f", x{side:.2f} beside the other ranks" if several and "side_by_side" in calibrated else ""
    return Rates(
        "cpu",
        f"measured on this CPU ({threads} thread{'s' * (threads > 1)} per rank{beside})",
        False,
        float(host_op),
        float(host_op_tp),
        0.0,
        cpu_bandwidth(threads),
        notes,
        table,
        None,
        threads,
        cpu_in_sequence(threads),
        side,
    )


def several_cpu_ranks(links: dict[str, Any], side: float) -> Rates:
    """A several-rank CPU run's rates at one thread per rank (as _cpu_rates prices it) with the
    collectives `links` and the in-step factor `side` given, before they are kept, the host's
    costs left at 0: what calibrate.py takes out of a pass it measured."""
    table = {"collectives": {"intra": links}}
    return Rates("cpu", "", False, 0.0, 0.0, 0.0, cpu_bandwidth(1), _table=table, _sequence=cpu_in_sequence(1), _side=side)


_CALIBRATED: dict[str, Any] = {}  # this process's own calibration, where the cache is off


def set_calibration(values: dict[str, Any]) -> None:
    _CALIBRATED.clear()
    _CALIBRATED.update(values)
    _cpu_rates.cache_clear()


def calibration() -> dict[str, Any]:
    """What `scaletrain plan --calibrate` measured on this machine (empty if never run)."""
    if _CALIBRATED:
        return dict(_CALIBRATED)
    path = disk_cache.cache_path(CALIBRATION_FILE)
    key = cpu_key("calibration")
    if path is None or key is None or not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw.get("values", {}) if raw.get("key") == key else {}


@lru_cache(maxsize=64)
def _gpu_rates(device: Device) -> Rates:
    kind = device.kind
    table, notes = load_table(kind)
    if table:
        return Rates(
            kind,
            f"the {kind} table measured {table.get('measured', '')} (torch {table.get('torch', '?')})",
            True,
            float(table.get("host_op_s", DATASHEET_HOST_OP)),
            float(table.get("host_op_tp_s", DATASHEET_HOST_OP_TP)),
            float(table.get("launch_s", DATASHEET_LAUNCH)),
            float(table.get("memory_bytes_per_s", DATASHEET_MEMORY * device.memory_bw)),
            notes,
            table,
            device,
        )
    notes.append(
        f"no measured table for {device.name}: its datasheet peaks x stated factors (matmuls {DATASHEET_MATMUL:.0%}, attention "
        f"{DATASHEET_ATTENTION:.0%}, memory {DATASHEET_MEMORY:.0%}; docs/planner.md), {DATASHEET_HOST_OP * 1e6:.0f} us of host per "
        "operation; scaletrain plan --calibrate on such a GPU measures them"
    )
    return Rates(
        kind or device.name,
        f"{device.name} datasheet x stated factors",
        True,
        DATASHEET_HOST_OP,
        DATASHEET_HOST_OP_TP,
        DATASHEET_LAUNCH,
        DATASHEET_MEMORY * (device.memory_bw or 2e12),
        notes,
        {},
        device,
    )


def _table_file(kind: str) -> Path | None:
    """Where `scaletrain plan --calibrate` keeps a GPU kind's table on this machine."""
    return disk_cache.cache_path(f"clock-table-{kind}.json")


def save_table(kind: str, table: dict[str, Any]) -> Path | None:
    path = _table_file(kind)
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table | {"kind": kind}, indent=1) + "\n")
    tmp.replace(path)
    _read_table.cache_clear()
    return path


@lru_cache(maxsize=16)
def _read_table(kind: str) -> dict[str, Any]:
    """The kind's table measured on this machine, else the committed one, else {}."""
    for path in (_table_file(kind), TABLES / f"{kind}.json"):
        if not kind or path is None or not path.is_file():
            continue
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return {}


def load_table(kind: str) -> tuple[dict[str, Any], list[str]]:
    """A kind's table and what to say of it (another torch: used, said)."""
    table = _read_table(kind)
    notes = []
    if table and table.get("torch") and str(table["torch"]).split("+")[0] != torch.__version__.split("+")[0]:
        notes.append(f"the {kind} table was measured with torch {table['torch']}, this is {torch.__version__}: used as it is")
    return table, notes
