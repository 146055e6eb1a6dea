"""Per-step metrics: recorded without host syncs, reduced across ranks once per interval.

Losses and grad norms stay on the device as 0-d tensors until `flush`, which does one
all-reduce of the stacked losses and one device-to-host copy for the whole interval;
metrics.jsonl still gets one JSON object per optimizer step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scaletrain import faults


class StepRecorder:
    """The loss logged is the mean over data-parallel ranks: a sum over `group` (all ranks
    while every rank is a data-parallel rank, i.e. tp = pp = 1) divided by `dp_size`."""

    def __init__(self, dp_size: int, distributed: bool, group: Any = None):
        self.dp_size = dp_size
        self.distributed = distributed
        self.group = group
        self._losses: list[torch.Tensor] = []
        self._norms: list[torch.Tensor] = []
        self._rows: list[dict[str, Any]] = []

    def record(self, local_loss: torch.Tensor, grad_norm: torch.Tensor, **fields: Any) -> None:
        self._losses.append(local_loss.detach().float())
        self._norms.append(grad_norm.detach().float())
        self._rows.append(fields)

    def flush(self) -> list[dict[str, Any]]:
        """Every rank must call this at the same steps (it is a collective when distributed)."""
        if not self._rows:
            return []
        losses = torch.stack(self._losses)
        if self.distributed:
            dist.all_reduce(losses, op=dist.ReduceOp.SUM, group=self.group)
            losses /= self.dp_size
        both = torch.stack([losses, torch.stack(self._norms).to(losses.device)]).cpu().tolist()
        rows = [
            {"step": row.pop("step"), "loss": loss, "grad_norm": norm, **row}
            for row, loss, norm in zip(self._rows, both[0], both[1])
        ]
        self._losses, self._norms, self._rows = [], [], []
        return rows


class MetricsLog:
    """metrics.jsonl: append-only during a run; on resume, rows after the checkpoint are dropped.

    One row per optimizer step, and event rows between them ({"step", "event": kind, ...},
    e.g. each checkpoint's blocking time, saves.py), which read_metrics leaves out unless
    asked for."""

    def __init__(self, path: Path, enabled: bool):
        self.path = path
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

    def truncate_after(self, step: int) -> None:
        """Keep rows up to `step`: later ones describe work lost with the process, redone now."""
        if not (self.enabled and self.path.exists()):
            return
        kept = [r for r in read_metrics(self.path, events=True) if r["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)


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
