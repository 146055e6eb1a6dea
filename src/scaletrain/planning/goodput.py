"""Goodput under failures (`scaletrain plan --mtbf-hours H`): checkpoint-and-restart at the
configured interval, at Young/Daly's optimal one, and replica groups (torchft), and which
to use. Pure arithmetic over the plan's step time and state size; docs/fault-tolerance.md
derives each formula and says which inputs are assumptions.

Goodput is the share of wall-clock time that ends up as kept training progress. With N
devices of mean time between failures M_d each, the job fails every M = M_d / N seconds
(failures independent, exponential).

Checkpoint-and-restart: every tau seconds of training a save blocks for delta. A failure
stops every rank: the work since the last checkpoint is lost (on average half of an
interval and its save, (tau + delta) / 2) and the job restarts, reloading its newest
checkpoint (R). To first order (Young 1974; Daly 2006):

    goodput = tau / (tau + delta) x (1 - (R + (tau + delta) / 2) / M)

and the interval that maximizes it is Daly's tau* = sqrt(2 delta M) - delta (delta < M / 2;
Young's sqrt(2 delta M) without the correction).

Replica groups (torchft, G groups of N / G devices): a failure takes out one group. The
others notice it in the step's fault-tolerant all-reduce (at worst after torchft's
operation timeout, 60 s by default), discard that step (every group redoes it: one step
time), and go on without the failed group, at (G - 1) / G of the job's throughput, while
it restarts (R) and receives the model and optimizer state from a live peer over the
network (X: a device's state / the inter-node bandwidth). Checkpoints are still written
at the configured interval (they guard against losing every group at once):

    goodput = tau / (tau + delta) x (1 - (step + T + (R + X) / G) / M)

with T the detection timeout. Both are first-order: they hold while the losses per
failure are small against M (the figures say when they are not).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

# torchft's Manager: timeout=timedelta(seconds=60) for its operations (torchft 0.2.0
# manager.py), the longest a surviving group waits on a collective with a dead peer.
TORCHFT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Failures:
    """What the estimate is computed from (seconds throughout)."""

    devices: int
    mtbf_hours: float  # per device
    step_s: float  # the plan's estimated optimizer step
    every_steps: int  # checkpoint.every (0: only at the end, which no failure waits for)
    save_s: float  # what a save blocks training for
    restart_s: float  # a restart of the job (or of one group): scheduling, start-up, loading
    groups: int  # replica groups (torchft)
    transfer_s: float  # a restarted group receiving the state from a live peer

    @property
    def job_mtbf_s(self) -> float:
        return self.mtbf_hours * 3600.0 / self.devices


def restart_goodput(f: Failures, interval_s: float) -> float:
    """Checkpoint-and-restart with `interval_s` of training between checkpoints."""
    cycle = interval_s + f.save_s
    return interval_s / cycle * max(0.0, 1.0 - (f.restart_s + cycle / 2.0) / f.job_mtbf_s)


def daly_interval_s(f: Failures) -> float:
    """Daly's optimal checkpoint interval (seconds of training); Young's past delta >= M / 2."""
    m, delta = f.job_mtbf_s, f.save_s
    young = math.sqrt(2.0 * delta * m)
    return young - delta if delta < m / 2.0 else young


def replica_goodput(f: Failures, interval_s: float) -> float:
    """Replica groups (torchft) with checkpoints every `interval_s` of training."""
    per_failure = f.step_s + TORCHFT_TIMEOUT_S + (f.restart_s + f.transfer_s) / f.groups
    return interval_s / (interval_s + f.save_s) * max(0.0, 1.0 - per_failure / f.job_mtbf_s)


@dataclass(frozen=True)
class GoodputEstimate:
    job_mtbf_h: float
    interval_steps: int
    restart: float  # goodput of checkpoint-and-restart at the configured interval
    optimal_steps: int  # Daly's interval, in steps
    restart_optimal: float
    replica_groups: float  # at the configured interval
    replica_groups_optimal: float  # at Daly's interval (the same checkpoints as restart_optimal)
    groups: int
    choice: str  # "restart" | "replica_groups"
    why: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate_goodput(f: Failures) -> GoodputEstimate:
    """Both ways, and the choice. They are compared at the same checkpoints, Daly's
    interval (its saves cost both alike), so that the difference is what a failure costs
    each; replica groups are chosen where they keep at least half a point more of the time
    (they are more moving parts)."""
    interval = (f.every_steps or 10**9) * f.step_s  # no periodic checkpoint: a failure loses the run so far
    optimal_steps = max(1, round(daly_interval_s(f) / f.step_s))
    optimal = optimal_steps * f.step_s
    at_configured, at_optimal = restart_goodput(f, interval), restart_goodput(f, optimal)
    groups, groups_optimal = replica_goodput(f, interval), replica_goodput(f, optimal)
    if groups_optimal - at_optimal >= 0.005:
        choice = "replica_groups"
        why = (
            f"at the same checkpoints replica groups keep {100 * (groups_optimal - at_optimal):.1f} points more of the time: "
            f"a failure costs one step, the detection timeout and 1/{f.groups} of the job for the restart and state "
            "transfer, instead of every device's work since the last checkpoint and a restart of all"
        )
    else:
        choice = "restart"
        why = (
            f"at the same checkpoints replica groups keep {100 * (groups_optimal - at_optimal):.2f} points more, less "
            "than half a point, for more moving parts"
        )
    return GoodputEstimate(
        f.job_mtbf_s / 3600.0,
        f.every_steps,
        at_configured,
        optimal_steps,
        at_optimal,
        groups,
        groups_optimal,
        f.groups,
        choice,
        why,
    )
