"""The optimizers (train.optimizer) and learning-rate schedules (train.schedule) scaletrain
knows: one entry each, carrying everything about it that the rest of the package asks.

This module is the optim package's door: torch-free and importing nothing of scaletrain but
the bottom layer, so that config validation reads the names and the engines each entry runs
on from here (tests/test_layering.py puts every `registry` module in the bottom layer), the
planner its memory and traffic terms, and the engines its builder (named by a path, imported
where the optimizer is built). Adding an optimizer is one module with a `build(groups, cfg,
device)` and one entry below; docs/architecture.md says how.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scaletrain.strategies import STRATEGIES

# The layouts an entry can leave unchecked: the config's field and its one accepted value.
LAYOUTS = {
    "cp": ("parallel.cp", 1),
    "pp": ("parallel.pp", 1),
    "tp": ("parallel.tp", 1),
    "ep": ("parallel.ep", 1),
    "dp_replicate": ("parallel.dp_replicate", 1),
    "offload_params": ("parallel.offload_params", "none"),
    "groups": ("fault_tolerance.groups", 1),
}

# The fp32 state torch's AdamW keeps per trained parameter (exp_avg, exp_avg_sq): what the
# strategy table's optimizer_bytes counts (strategies.py), the engine's own fp32 master beside.
ADAMW_STATE_BYTES = 8.0


@dataclass(frozen=True)
class Optimizer:
    """One train.optimizer value."""

    name: str
    about: str  # one line: what it is (docs, `scaletrain plan`, messages)
    builder: str  # "module:function", the function taking (groups, train config, device)
    strategies: tuple[str, ...]  # the engines that build it
    why_not_others: str  # why the others do not (the refusal says it)
    # Layouts (keys of LAYOUTS) it has not been checked with: refused, "not checked yet".
    unchecked: tuple[str, ...] = ()
    # The planner's terms: fp32 state per trained parameter; where the blocks' matrices are
    # stepped by a rule of their own (Muon), their state per parameter, and whether a
    # sharded engine gathers each whole matrix's update once per step to apply it.
    state_bytes: float = ADAMW_STATE_BYTES
    matrix_state_bytes: float | None = None
    gathers_matrices: bool = False
    clock_note: str = ""  # where the clock prices its step as something else
    # The checkpoint: the per-parameter state tensors it saves (torch's names, under
    # optim.state.<parameter>.<key>) and whether the engines' neutral layout (N->M resume,
    # DeepSpeed <-> FSDP2, engines/base.py) maps it: AdamW's moments only.
    state_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    cross_engine: bool = False
    # The schedule a run takes when train.schedule is not given (None: the config's default).
    schedule: str | None = None

    @property
    def splits_matrices(self) -> bool:
        return self.matrix_state_bytes is not None


OPTIMIZERS: dict[str, Optimizer] = {
    o.name: o
    for o in (
        Optimizer(
            "adamw",
            "torch's AdamW (fused where torch has the kernel) for every trained parameter",
            "scaletrain.optim.optimizers:build_adamw",
            strategies=STRATEGIES,
            why_not_others="",
            cross_engine=True,
        ),
        Optimizer(
            "muon",
            "torch's Muon for the blocks' matrices (updates matched to AdamW's RMS), AdamW for the rest, at one lr",
            "scaletrain.optim.muon:build",
            strategies=("ddp", "fsdp"),
            why_not_others="DeepSpeed 0.19.8's own Muon is another step: Keller Jordan's learning-rate scaling, not the "
            "AdamW-matched one a shared train.lr needs, a Gram Newton-Schulz, and groups its engine rebuilds without "
            "train.param_groups' multipliers; not wired",
            unchecked=("cp", "pp", "dp_replicate", "offload_params", "groups"),
            # torch's Muon keeps one fp32 momentum per element of the matrices it steps.
            matrix_state_bytes=4.0,
            gathers_matrices=True,
            clock_note="its step priced as AdamW's (Newton-Schulz not in the clock yet)",
            state_keys=("momentum_buffer", "exp_avg", "exp_avg_sq"),
        ),
        Optimizer(
            "schedule_free_adamw",
            "schedule-free AdamW (the schedulefree package): no decay schedule; evaluation and checkpoints take its "
            "averaged weights",
            "scaletrain.optim.schedule_free:build",
            strategies=("ddp", "fsdp"),
            why_not_others="DeepSpeed's ZeRO optimizer steps its own flat fp32 partitions and would not switch "
            "schedule-free's averaged and training weights around evaluation and saves; not wired",
            unchecked=("cp", "pp", "tp", "ep", "dp_replicate", "offload_params", "groups"),
            # z (the base sequence) and exp_avg_sq; the weights hold y in training, x in saves.
            state_keys=("z", "exp_avg_sq"),
            clock_note="its step priced as AdamW's (the same element-wise passes)",
            schedule="constant",
        ),
    )
}


def optimizer(name: str) -> Optimizer:
    """The entry of train.optimizer `name` (validated by the config: always there)."""
    return OPTIMIZERS[name]


def layout_problem(entry: Optimizer, values: dict[str, Any]) -> tuple[str, str] | None:
    """The first of the entry's unchecked layouts that `values` ({LAYOUTS key: the config's
    value}) asks for: (what was given, what is accepted); None where all are plain."""
    for key in entry.unchecked:
        field, plain = LAYOUTS[key]
        if values.get(key, plain) != plain:
            return f"{field}={values[key]}", f"{field}={plain}"
    return None


@dataclass(frozen=True)
class Schedule:
    """One train.schedule value: after the linear warmup, the share of the way from the floor
    (peak x min_lr_ratio) to the peak that is left at `progress` (0 -> 1) of its decay."""

    name: str
    about: str
    left: Callable[[float, Any], float]  # (progress, the train config) -> share in [0, 1]
    # Which steps it decays over: "rest", every step after the warmup; "last", the last
    # train.decay_steps (a run can be extended, or a cooldown branched, from any checkpoint
    # before them: training/rundir.py); "none", the peak to the end.
    decays_over: str = "rest"

    @property
    def extendable(self) -> bool:
        """Whether a run's checkpoints before its decay can be continued past its steps."""
        return self.decays_over != "rest"


def _wsd_left(progress: float, train: Any) -> float:
    return 1 - math.sqrt(progress) if train.decay_shape == "1-sqrt" else 1 - progress


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("cosine", "cosine decay over the steps after the warmup", lambda p, _: 0.5 * (1 + math.cos(math.pi * p))),
        Schedule("linear", "linear decay over the steps after the warmup", lambda p, _: 1 - p),
        Schedule("constant", "the peak from the warmup's end", lambda p, _: 1.0, decays_over="none"),
        Schedule(
            "wsd",
            "warmup-stable-decay: the peak until the last train.decay_steps, then train.decay_shape (1-sqrt or linear)",
            _wsd_left,
            decays_over="last",
        ),
    )
}


def accepted(table: dict[str, Any]) -> str:
    """'a, b or c': the names of a registry, for a refusal."""
    names = list(table)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
