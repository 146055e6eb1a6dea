"""A predicted step by phase: what the clock (clock/step.py) hands the plan, and what
`--explain-time` and diagnose read."""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("data", "forward", "backward", "optimizer", "comm", "bubble", "offload", "other")


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step by phase, the largest items of each, and what was assumed."""

    phases: dict[str, float]
    largest: dict[str, tuple[tuple[str, float], ...]] = field(default_factory=dict)
    source: str = ""
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def as_dict(self) -> dict:
        return {
            "seconds": self.total,
            "phases": dict(self.phases),
            "largest": {k: [[label, s] for label, s in v] for k, v in self.largest.items()},
            "rates": self.source,
            "notes": list(self.notes),
        }
