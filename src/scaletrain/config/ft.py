"""The config's `fault_tolerance` section: replica groups that outlive a failed one
(torchft; scaletrain/replica_groups.py). Part of the one schema in scaletrain/config.py,
which re-exports it and calls `fault_tolerance_problem` once the whole config is known.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from scaletrain.config.model import MOE_PRESETS, Section
from scaletrain.strategies import TABLE, names_where, said


class DiLoCoSection(Section):
    # Local optimizer steps inside each group between two outer steps; 0: off (the groups
    # average their gradients every step instead).
    sync_every: int = Field(0, ge=0)
    # The outer step: Nesterov SGD on the pseudo-gradient (the weights at the last outer
    # step minus the weights now, averaged over the live groups); DiLoCo's values.
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1)


class FaultToleranceConfig(Section):
    # Replica groups: each a whole copy of today's layout (ddp, or fsdp with tp); across
    # groups the gradients are averaged over the groups alive in the step's quorum, and a
    # failed group restarts and rejoins from a live one. 1: off.
    groups: int = Field(1, ge=1)
    # Steps are committed only while at least this many groups take part.
    min_groups: int = Field(1, ge=1)
    # The lighthouse that forms the quorums: http://HOST:PORT. Empty: the TORCHFT_LIGHTHOUSE
    # that `scaletrain launch --ft-groups N` sets (it starts one on this machine).
    lighthouse: str = ""
    # A cross-group collective or a state transfer that takes longer fails the step (the
    # group that did not answer is left out of the next quorum); seconds.
    timeout_s: float = Field(60.0, gt=0)
    # How long a group waits for a quorum to form (a restarting group's peers wait for it
    # only until the lighthouse stops hearing it); seconds.
    quorum_timeout_s: float = Field(60.0, gt=0)
    # The lighthouse `launch --ft-groups` starts leaves a group out of the quorum once it has
    # not heard from it for this long (torchft's default); seconds.
    heartbeat_timeout_s: float = Field(5.0, gt=0)
    diloco: DiLoCoSection = Field(default_factory=DiLoCoSection)

    @model_validator(mode="after")
    def _enough_groups(self) -> FaultToleranceConfig:
        if self.min_groups > self.groups:
            raise ValueError(
                f"fault_tolerance.min_groups={self.min_groups} exceeds fault_tolerance.groups={self.groups}; accepted: "
                f"1..{self.groups}"
            )
        return self


def fault_tolerance_problem(cfg: Any) -> str | None:
    """What in the rest of the config replica groups do not go with, or None."""
    ft, par, m = cfg.fault_tolerance, cfg.parallel, cfg.model
    if ft.groups == 1:
        return None
    if par.strategy not in TABLE or not TABLE[par.strategy].replica_groups:
        where = said(names_where(lambda s: s.replica_groups))
        why = TABLE[par.strategy].no_replica_groups_why if par.strategy in TABLE else "auto chooses among all strategies"
        return f"fault_tolerance.groups={ft.groups} needs parallel.strategy={where}, not {par.strategy} ({why})"
    unchecked = [
        (par.pp > 1, f"parallel.pp={par.pp}"),
        (par.cp > 1, f"parallel.cp={par.cp}"),
        (par.dp_replicate > 1, f"parallel.dp_replicate={par.dp_replicate}"),
        (m.moe is not None or m.preset in MOE_PRESETS, "a mixture of experts"),
        (cfg.train.nonfinite == "rollback", "train.nonfinite=rollback (only group 0 holds checkpoints)"),
        (par.grad_compression != "none", f"parallel.grad_compression={par.grad_compression}"),
        (par.offload_params != "none", f"parallel.offload_params={par.offload_params}"),
    ]
    for bad, given in unchecked:
        if bad:
            return f"fault_tolerance.groups={ft.groups} does not combine with {given} (not checked yet)"
    if ft.diloco.sync_every and not TABLE[par.strategy].whole_replicas:
        return (
            f"fault_tolerance.diloco.sync_every={ft.diloco.sync_every} averages whole weights across groups; "
            f"parallel.strategy={par.strategy} shards them (not checked yet); accepted: parallel.strategy="
            f"{said(names_where(lambda s: s.replica_groups and s.whole_replicas))}"
        )
    return None
