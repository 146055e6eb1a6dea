"""AdamW and its default parameter groups (decay on matrices only), and the warmup + cosine LR schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from scaletrain.config import TrainConfig


def decay_groups(weight_decay: float) -> Callable[[nn.Module], list[dict[str, Any]]]:
    """The default parameter groups (engines.ParamGroups): every trainable parameter, with
    decoupled weight decay on matrices only. Norm gains (1-D) are not decayed: decaying
    them pulls activations toward zero."""

    def groups(model: nn.Module) -> list[dict[str, Any]]:
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for p in model.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        # No empty group: where only matrices train (LoRA adapters, attention projections),
        # torch's flattened optimizer state cannot be loaded back into an optimizer with an
        # empty group (state_dict._unflatten_optim_state_dict indexes its first parameter).
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    return groups


def build_adamw(groups: list[dict[str, Any]], cfg: TrainConfig, fused: bool = False) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=fused or None)


def scaled_lr(cfg: TrainConfig, global_batch: int) -> float:
    """Peak LR for the effective batch actually run (opt-in; see train.lr_scaling)."""
    if cfg.lr_scaling == "none" or cfg.lr_base_batch is None:
        return cfg.lr
    ratio = global_batch / cfg.lr_base_batch
    return cfg.lr * (ratio if cfg.lr_scaling == "linear" else math.sqrt(ratio))


def lr_at(step: int, cfg: TrainConfig, peak: float | None = None) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then cosine to peak*min_lr_ratio.

    A pure function of the step, so the schedule's whole state is the step number and
    resume can never desynchronise it. `peak` defaults to train.lr (see scaled_lr).
    """
    peak = cfg.lr if peak is None else peak
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = peak * cfg.min_lr_ratio
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))
