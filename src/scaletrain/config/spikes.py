"""The config's `train.spikes` section: finite loss and gradient-norm spikes, caught and
handled (resilience/spikes.py). Off unless `train.spikes.enabled=true`; the defaults below
are what that turns on. Part of the one schema in config/schema.py, which checks
`spikes_problem` once the whole config is known."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from scaletrain.config.model import Section
from scaletrain.strategies import TABLE, names_where, said


class SpikesSection(Section):
    enabled: bool = False
    # The trailing window of accepted steps the threshold is taken over (median and MAD);
    # no step is judged before it holds `min_steps`.
    window: int = Field(100, ge=4)
    min_steps: int = Field(50, ge=4)
    # A spike: a value above median + threshold x the robust spread (1.4826 x MAD, at least a
    # floor x the median: a window of near-equal values would flag every wiggle). Gradient
    # norms are heavy-tailed where losses are not: on this project's tiny runs a norm 2-3x
    # its median comes every few dozen steps, so its floor makes a spike at least 4x the
    # median (1 + 6 x 0.5), the loss's at least 1.12x.
    threshold: float = Field(6.0, gt=0)
    loss_floor: float = Field(0.02, ge=0)
    grad_norm_floor: float = Field(0.5, ge=0)
    # Escalation, over the spikes of the trailing `window` steps: each gradient-norm spike's
    # update is skipped (the norm is known before the optimizer step); at `lr_after` spikes
    # the learning rate is multiplied by `lr_factor` for `lr_steps` steps; at `rollback_after`
    # the run goes back to its newest checkpoint and skips the data read since (0: never).
    lr_after: int = Field(2, ge=1)
    lr_factor: float = Field(0.5, gt=0, le=1)
    lr_steps: int = Field(100, ge=1)
    rollback_after: int = Field(4, ge=0)


def spikes_problem(cfg: Any) -> str | None:
    """Where train.spikes cannot decide before the optimizer step: DeepSpeed's own step
    computes the norm and applies the update in one call, and fp16's loss scaler owns which
    steps are skipped."""
    s = cfg.train.spikes
    if not s.enabled:
        return None
    strategy = cfg.parallel.strategy
    if strategy != "auto" and not TABLE[strategy].holds_back:
        return (
            f"train.spikes does not run with parallel.strategy={strategy}: DeepSpeed computes the gradient norm "
            f"and applies the update in one call, so a spike cannot be held back; accepted: parallel.strategy="
            f"{said(names_where(lambda r: r.holds_back))}, or train.spikes.enabled=false"
        )
    if cfg.precision == "fp16":
        return (
            "train.spikes does not run with precision=fp16: its loss scaler decides which steps are skipped; "
            "accepted: precision=bf16|fp32, or train.spikes.enabled=false"
        )
    if s.min_steps > s.window:
        return f"train.spikes.min_steps={s.min_steps} exceeds train.spikes.window={s.window}; accepted: min_steps <= window"
    if s.rollback_after and s.rollback_after < s.lr_after:
        return (
            f"train.spikes.rollback_after={s.rollback_after} comes before lr_after={s.lr_after}; accepted: rollback_after >= "
            "lr_after, or 0 (never roll back)"
        )
    return None
