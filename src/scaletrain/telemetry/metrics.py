"""Per-step metrics: recorded without host syncs, gathered across ranks once per interval.

Losses, grad norms and the other per-step figures an engine keeps on the device (the loss
scale, whether a step was skipped) stay there as 0-d tensors until `flush`, which reads
them with a mixture of experts' routing sums in one device-to-host copy, and does one
all_gather_object (on a gloo side group, so nothing of it touches the GPU) of everything
the interval needs from every rank: losses, the phase times, memory, the communication
sample, the expert load (experts.py). metrics.jsonl still gets one JSON object per
optimizer step, and event rows: the interval's figures and its stragglers.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scaletrain.launch.distributed import World, side_group
from scaletrain.resilience import faults
from scaletrain.telemetry.clock import PhaseClock
from scaletrain.telemetry.device import gpu_utilisation, memory_peak
from scaletrain.telemetry.experts import expert_load
from scaletrain.telemetry.syncs import host_only


@dataclass(frozen=True)
class Rates:
    """What turns step counts into throughput, MFU and cost."""

    tokens_per_step: int  # all data-parallel ranks
    samples_per_step: int
    flops_per_token: float  # training (forward + backward)
    peak_flops: float | None  # per device
    devices: int
    memory_bytes: float  # per device
    cost_per_gpu_hour: float
    straggler_threshold: float
    micro_batches: int = 1  # forwards per optimizer step on each rank (train.grad_accum)


@dataclass
class Flushed:
    rows: list[dict[str, Any]] = field(default_factory=list)  # step rows, every rank
    events: list[dict[str, Any]] = field(default_factory=list)  # interval + stragglers (rank 0 writes)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # ranks.jsonl rows


class StepRecorder:
    """The loss logged is the mean over data-parallel ranks (the ranks of one tp group all
    hold their group's loss); the phase and memory figures are per rank, in ranks.jsonl."""

    def __init__(self, world: World, hosts: list[str], clock: PhaseClock, rates: Rates, gpu_hours: float = 0.0):
        self.world = world
        self.hosts = hosts
        self.clock = clock
        self.rates = rates
        self.gpu_hours = gpu_hours  # so far, the runs this one resumed included
        self._group = side_group("telemetry") if world.distributed else None
        self._losses: list[torch.Tensor] = []
        self._norms: list[torch.Tensor] = []
        self._rows: list[dict[str, Any]] = []
        self._since = time.perf_counter()
        # The routing statistics the model summed since the last call (models.moe.routing_stats),
        # None for a dense model; set by whoever holds the model (Telemetry.watch_routing).
        self.routing: Callable[[], torch.Tensor | None] = lambda: None
        # model.moe.balance=bias: the experts' bias table [MoE layers, experts] (models.moe.
        # ExpertBias; the same on every rank), read with the rest at each flush; else None.
        self.bias: Callable[[], torch.Tensor | None] = lambda: None
        # A data mixture's realised shares over the interval (data/mix.py: MixShares.take),
        # None without one; every rank computes it from the position alone, so nothing is gathered.
        self.mix: Callable[[], dict[str, Any] | None] = lambda: None
        # Each optimizer group's learning rate at the interval's last step (optim/optimizers.py
        # group_lrs), where the groups differ (train.param_groups, Muon beside AdamW); else None.
        self.group_lrs: Callable[[], list[dict[str, Any]] | None] = lambda: None

    def record(self, local_loss: torch.Tensor, grad_norm: torch.Tensor, **fields: Any) -> None:
        """One step's row; a tensor among `fields` (a 0-d one: the loss scale, whether the
        step was skipped) stays on the device until the flush reads it with the rest."""
        self._losses.append(local_loss.detach())
        self._norms.append(grad_norm.detach())
        self._rows.append(fields)

    def _read(self) -> tuple[list[float], list[float], np.ndarray | None, np.ndarray | None]:
        """The interval's device figures in one read: this rank's losses and gradient norms,
        the rows' tensor fields (in place), the expert load (taken here, once per interval)
        and the experts' bias."""
        device = self._losses[0].device
        fields = [(row, k) for row in self._rows for k, v in row.items() if isinstance(v, torch.Tensor)]
        routing, bias = self.routing(), self.bias()
        parts = [torch.stack(self._losses), torch.stack([t.to(device) for t in self._norms])]
        parts += [row[k].to(device).reshape(1) for row, k in fields]
        if routing is not None:
            parts.append(routing.to(device).reshape(-1))
        if bias is not None:
            parts.append(bias.to(device).reshape(-1))
        # float64: exact for the fp32 losses and for the routing's slot counts, whatever they sum to.
        values = torch.cat([p.double() for p in parts]).tolist()  # the one read of the interval
        n = len(self._rows)
        losses, norms, rest = values[:n], values[n : 2 * n], values[2 * n :]
        for (row, k), v in zip(fields, rest):
            row[k] = bool(v) if row[k].dtype == torch.bool else v
        rest = rest[len(fields) :]
        moe = table = None
        if routing is not None:
            moe, rest = np.asarray(rest[: routing.numel()], dtype=np.float64).reshape(routing.shape), rest[routing.numel() :]
        if bias is not None:
            table = np.asarray(rest, dtype=np.float32).reshape(bias.shape)
        return losses, norms, moe, table

    def flush(self, comm: dict[str, float] | None = None) -> Flushed:
        """Collective when distributed (every rank calls it at the same steps). `comm`: this
        rank's communication sample of the interval, if one was taken (telemetry.comm)."""
        if not self._rows:
            return Flushed()
        losses, norms, routing, bias = self._read()
        phases = self.clock.take()
        peak, reserved = memory_peak(self.world.device)
        n = len(self._rows)
        mine: dict[str, Any] = {
            "losses": losses,
            "phases": {f"{k}_s": v / n for k, v in phases.items()},
            "mem_peak_bytes": peak,
            "mem_reserved_bytes": reserved,
            "gpu_util": gpu_utilisation(self.world.device),
            "comm": comm,
            "moe": routing,
        }
        everyone = [mine] * self.world.world_size
        if self._group is not None:
            with host_only():  # a gloo side group: pickled into CPU tensors, none on the device
                torch.distributed.all_gather_object(everyone, mine, group=self._group)
        now = time.perf_counter()
        wall, self._since = now - self._since, now
        # Summed in rank order in fp32, as an all-reduce of the stacked losses would (numpy:
        # host arithmetic on host values, which no host-sync count mistakes for a read). The
        # tensor-parallel ranks of one data-parallel rank each hold its loss, so the mean
        # over all ranks is the mean over data-parallel ranks.
        mean = np.asarray([r["losses"] for r in everyone], dtype=np.float32).sum(0) / np.float32(len(everyone))
        rows = [
            {"step": row.pop("step"), "loss": loss, "grad_norm": norm, **row}
            for row, loss, norm in zip(self._rows, mean.tolist(), norms)
        ]
        self._losses, self._norms, self._rows = [], [], []
        step = rows[-1]["step"]
        ranks = [self._rank_row(step, rank, n, wall, r) for rank, r in enumerate(everyone)]
        interval = self._interval(step, n, wall, ranks)
        moe = expert_load([r["moe"] for r in everyone], n * self.rates.micro_batches)
        if moe is not None:
            if bias is not None:  # as the next step routes with it (every rank holds the same)
                for layer, row in zip(moe["layers"], bias.tolist()):
                    layer["bias"] = [float(f"{x:.6g}") for x in row]
            interval["moe"] = moe
        mix = self.mix()
        if mix is not None:
            interval["mix"] = mix
        groups = self.group_lrs()
        if groups is not None:
            interval["lr_groups"] = groups
        return Flushed(rows, [interval, *self._stragglers(step, ranks)], ranks)

    def _rank_row(self, step: int, rank: int, n: int, wall: float, r: dict[str, Any]) -> dict[str, Any]:
        row = {"step": step, "rank": rank, "host": self.hosts[rank], "steps": n, "step_s": wall / n, **r["phases"]}
        comm = r["comm"]
        # The sample's exposed share applied to this interval's step time (docs/telemetry.md).
        row["comm_s"] = comm["comm_s"] / comm["total_s"] * row["step_s"] if comm and comm["total_s"] > 0 else None
        row["sample"] = comm
        row.update({k: r[k] for k in ("mem_peak_bytes", "mem_reserved_bytes", "gpu_util")})
        return row

    def _interval(self, step: int, n: int, wall: float, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        rates = self.rates
        self.gpu_hours += rates.devices * wall / 3600
        tokens_per_s = rates.tokens_per_step * n / wall
        phases = {}
        for key in ("data_s", "forward_s", "backward_s", "optimizer_s", "comm_s"):
            values = [r[key] for r in ranks if r[key] is not None]
            phases[key] = statistics.median(values) if values else None
        step_s = wall / n
        phases["other_s"] = max(0.0, step_s - sum(phases[k] or 0.0 for k in ("data_s", "forward_s", "backward_s", "optimizer_s")))
        utils = [r["gpu_util"] for r in ranks if r["gpu_util"] is not None]
        return {
            "step": step,
            "event": "interval",
            "steps": n,
            "wall_s": wall,
            "step_s": step_s,
            "tokens_per_s": tokens_per_s,
            "samples_per_s": rates.samples_per_step * n / wall,
            "effective_batch": rates.samples_per_step,
            "mfu": tokens_per_s * rates.flops_per_token / (rates.devices * rates.peak_flops) if rates.peak_flops else None,
            "mem_peak_bytes": max(r["mem_peak_bytes"] for r in ranks),
            "mem_capacity_bytes": rates.memory_bytes,
            "gpu_util": sum(utils) / len(utils) if utils else None,
            "gpu_hours": self.gpu_hours,
            "cost": self.gpu_hours * rates.cost_per_gpu_hour if rates.cost_per_gpu_hour else None,
            "phases": phases,
        }

    def _stragglers(self, step: int, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Synchronous training makes every rank's step equally long (the fast ones wait), so a
        straggler shows in its busy time: the sampled step minus the communication it
        waited for. Only intervals with a sample on every rank are judged."""
        if len(ranks) < 2 or any(r["sample"] is None for r in ranks):
            return []
        busy = [r["sample"]["total_s"] - r["sample"]["comm_s"] for r in ranks]
        median = statistics.median(busy)
        if median <= 0:
            return []
        return [
            {
                "step": step,
                "event": "straggler",
                "rank": r["rank"],
                "host": r["host"],
                "step_s": b,
                "median_s": median,
                "excess": b / median - 1,
            }
            for r, b in zip(ranks, busy)
            if b > median * (1 + self.rates.straggler_threshold)
        ]


class MetricsLog:
    """metrics.jsonl: append-only during a run; on resume, rows after the checkpoint are dropped.

    One row per optimizer step, and event rows between them ({"step", "event": kind, ...},
    e.g. each checkpoint's blocking time, training/saves.py), which read_metrics leaves out unless
    asked for. ranks.jsonl beside it: one row per rank per interval."""

    def __init__(self, path: Path, enabled: bool):
        self.path = path
        self.ranks_path = path.with_name("ranks.jsonl")
        self.enabled = enabled

    def write(self, rows: list[dict[str, Any]]) -> None:
        if not (self.enabled and rows):
            return
        text = "".join(json.dumps(r) + "\n" for r in rows)
        with open(self.path, "a") as f:
            if faults.armed("metrics", rows[-1]["step"]):
                f.write(text[: len(text) // 2])  # a row cut short, as a kill mid-write leaves it
                f.flush()
                faults.kill()
            f.write(text)

    def write_flushed(self, flushed: Flushed) -> None:
        self.write(flushed.rows + flushed.events)
        if self.enabled and flushed.ranks:
            with open(self.ranks_path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in flushed.ranks))

    def truncate_after(self, step: int) -> None:
        """Keep rows up to `step`: later ones describe work lost with the process, redone now."""
        if not self.enabled:
            return
        for path in (self.path, self.ranks_path):
            if path.exists():
                kept = [r for r in read_metrics(path, events=True) if r["step"] <= step]
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                os.replace(tmp, path)

    def gpu_hours(self) -> float:
        """GPU-hours recorded so far (after truncate_after: up to the resumed checkpoint)."""
        if not (self.enabled and self.path.exists()):
            return 0.0
        intervals = [r for r in read_metrics(self.path, events=True) if r.get("event") == "interval"]
        return intervals[-1]["gpu_hours"] if intervals else 0.0


def read_metrics(path: Path, events: bool = False) -> list[dict[str, Any]]:
    """The step rows of a metrics.jsonl, in order; with `events`, the event rows as well."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill mid-write
        if events or "event" not in row:
            rows.append(row)
    return rows
