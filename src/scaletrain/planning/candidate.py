"""What the planner hands back: each candidate layout with its estimate, and the plan that
chose among them (planner.py computes them; report.py and the CLI show them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scaletrain.planning.clock.phases import StepTime
from scaletrain.planning.hardware import Device
from scaletrain.planning.memory import Memory
from scaletrain.planning.setup import Setup


@dataclass
class Candidate:
    setup: Setup
    memory: Memory
    comm_bytes: float  # per device per optimizer step, sent over the network
    step_time: float  # seconds, estimated
    fits: bool
    why_not: str = ""
    tp_comm_bytes: float = 0.0  # of comm_bytes: tensor parallel's own, inside a node
    pp_comm_bytes: float = 0.0  # of comm_bytes: pipeline activations between stages
    # Not fitting at the configured micro-batch: the same setup at the largest smaller one
    # that fits, at the same global batch (also among the plan's candidates).
    smaller: Candidate | None = None
    ep_comm_bytes: float = 0.0  # of comm_bytes: expert parallel's all-to-all of the routed tokens
    cp_comm_bytes: float = 0.0  # of comm_bytes: context parallel's key/value gathers
    time: StepTime | None = None  # step_time by phase (planning/clock/step.py)

    @property
    def dp_bytes(self) -> float:
        """What it moves over its data-parallel ranks: its traffic less tp's, pp's, ep's and cp's own."""
        return self.comm_bytes - self.tp_comm_bytes - self.pp_comm_bytes - self.ep_comm_bytes - self.cp_comm_bytes

    def as_dict(self, moe: bool = False) -> dict:
        out = {
            "strategy": self.setup.label,
            "fits": self.fits,
            "memory": self.memory.as_dict(),
            "comm_bytes_per_step": self.comm_bytes,
            "tp_comm_bytes_per_step": self.tp_comm_bytes,
            "pp_comm_bytes_per_step": self.pp_comm_bytes,
            "step_time_s": self.step_time,
            "why_not": self.why_not,
            "micro_batch": self.setup.micro_batch,
            "grad_accum": self.setup.grad_accum,
            "fits_with_micro_batch": self.smaller.setup.micro_batch if self.smaller else None,
        }
        # Only a mixture of experts has these: a dense model's JSON stays as it was.
        if moe:
            out |= {"ep": self.setup.ep, "ep_comm_bytes_per_step": self.ep_comm_bytes}
        if self.setup.float8:  # only float8 layouts: the other rows stay as they were
            out["float8"] = True
        if self.setup.cp > 1:  # only layouts with cp: the other rows stay as they were
            out |= {"cp": self.setup.cp, "cp_comm_bytes_per_step": self.cp_comm_bytes}
        return out


@dataclass
class Plan:
    world: int
    nodes: int
    device: Device
    usable: float  # bytes per device the plan may use (memory minus headroom)
    candidates: list[Candidate]
    chosen: Candidate
    reasons: list[str]
    max_micro_batch: int
    notes: list[str] = field(default_factory=list)
    batch_choice: str = ""  # why the chosen micro-batch, when the planner chose it
    # A mixture of experts: its parameters (total and active per token), experts and FLOPs
    # per token (experts.moe_summary); empty for a dense model.
    moe: dict[str, Any] = field(default_factory=dict)
    # train.float8: the chosen layout's step time and peak beside the same in bf16 (planning/float8.py).
    float8: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = {
            "world": self.world,
            "nodes": self.nodes,
            "device": self.device.name,
            "device_memory": self.device.memory,
            "usable_memory": self.usable,
            "chosen": self.chosen.setup.label,
            "chosen_strategy": self.chosen.setup.strategy,
            "reasons": self.reasons,
            "max_micro_batch": self.max_micro_batch,
            "micro_batch": self.chosen.setup.micro_batch,
            "grad_accum": self.chosen.setup.grad_accum,
            "batch_choice": self.batch_choice,
            "notes": self.notes,
            "candidates": [c.as_dict(bool(self.moe)) for c in self.candidates],
        }
        if self.moe:
            out["moe"] = self.moe | {"ep": self.chosen.setup.ep}
        if self.float8:
            out["float8"] = self.float8
        return out
