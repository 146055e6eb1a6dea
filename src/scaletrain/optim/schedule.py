"""The learning-rate schedules (train.schedule, optim/registry.py's SCHEDULES): linear
warmup, then the entry's decay; and the peak scaled with the batch (train.lr_scaling)."""

from __future__ import annotations

import math

from scaletrain.config import TrainConfig
from scaletrain.optim.registry import SCHEDULES


def scaled_lr(cfg: TrainConfig, global_batch: int) -> float:
    """Peak LR for the effective batch actually run (opt-in; see train.lr_scaling)."""
    if cfg.lr_scaling == "none" or cfg.lr_base_batch is None:
        return cfg.lr
    ratio = global_batch / cfg.lr_base_batch
    return cfg.lr * (ratio if cfg.lr_scaling == "linear" else math.sqrt(ratio))


def lr_at(step: int, cfg: TrainConfig, peak: float | None = None) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then train.schedule down to
    peak * min_lr_ratio (constant: none). The decay's progress runs from 0 at its first step
    by 1 / its length each step (cosine's convention since the first release, kept by the
    others): its last step is one short of the floor.

    A pure function of the step, so the schedule's whole state is the step number and
    resume can never desynchronise it. `peak` defaults to train.lr (see scaled_lr).
    """
    peak = cfg.lr if peak is None else peak
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    schedule = SCHEDULES[cfg.schedule]
    if schedule.decays_over == "none":
        return peak
    start, length = cfg.warmup_steps, cfg.steps - cfg.warmup_steps
    if schedule.decays_over == "last":
        length = wsd_decay_steps(cfg)
        start = cfg.steps - length
        if step < start:
            return peak  # the stable phase
    progress = min(1.0, (step - start) / max(1, length))
    floor = peak * cfg.min_lr_ratio
    return floor + (peak - floor) * schedule.left(progress, cfg)


def wsd_decay_steps(cfg: TrainConfig) -> int:
    """The length of a decay over the last steps (wsd): train.decay_steps, or a fifth of the
    run (at least one step, at most the steps after the warmup)."""
    if cfg.decay_steps is not None:
        return cfg.decay_steps
    return max(1, min(cfg.steps - cfg.warmup_steps, round(cfg.steps / 5)))
