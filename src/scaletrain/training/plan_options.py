"""What `scaletrain plan` and scaletrain.plan take besides the config, checked before
anything heavy is imported (training/planned.py plans with them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scaletrain.errors import UserError


@dataclass(frozen=True)
class PlanOptions:
    """What `scaletrain plan` takes besides the config, as its flags name it (an argparse
    Namespace of the command serves as well): the machine planned for and how."""

    gpus_per_node: int = 8
    nodes: int = 1
    gpu: str | None = None  # h100 (default), h200, a100, ..., or cpu (this machine)
    gpu_memory: str | None = None  # e.g. 80GiB (default: the GPU's)
    cpu_memory: str | None = None
    headroom: float = 0.1
    configured_only: bool = False
    device_defaults: bool = False
    emit_deepspeed: str | None = None
    mtbf_hours: float | None = None
    restart_minutes: float = 10.0
    ft_groups: int | None = None
    save_seconds: float | None = None


def check_options(opts: Any) -> None:
    """The numbers among the plan's options, checked before anything heavy is imported."""
    if not 0 <= opts.headroom < 1:
        raise UserError(f"--headroom {opts.headroom} is invalid; accepted: a fraction in [0, 1)")
    if opts.mtbf_hours is not None and not 0 < opts.mtbf_hours < float("inf"):
        raise UserError(f"--mtbf-hours {opts.mtbf_hours} is invalid; accepted: a finite number of hours > 0")
    for flag, value in (("--restart-minutes", opts.restart_minutes), ("--save-seconds", opts.save_seconds)):
        if value is not None and not 0 <= value < float("inf"):
            raise UserError(f"{flag} {value} is invalid; accepted: a finite number >= 0")
