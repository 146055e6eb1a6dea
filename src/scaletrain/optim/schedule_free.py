"""train.optimizer=schedule_free_adamw: schedule-free AdamW (Defazio et al. 2024, the
`schedulefree` package's AdamWScheduleFree).

It replaces the learning-rate decay by an average: the parameters step a sequence y, built
from a base sequence z (its state beside AdamW's second moment) and the weighted average x of
the z's, and the model worth evaluating or keeping is x. So the optimizer has two modes, and
optim/optimizers.py's `averaged` switches it to x around each evaluation and save and back to
y after (the engines call it); a checkpoint holds x with z, and a load switches back to y:
every run makes the same switches at the same steps, so resume is exact. train.schedule is
constant unless set (the config takes the entry's), after train.warmup_steps: scaletrain sets
each step's lr as for any optimizer, and the package weighs its average by the largest lr
seen squared (its own warmup's rule, `weight_lr_power=2`). Its step is element-wise, so
FSDP2's sharded parameters (DTensors) take it as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from scaletrain.errors import UserError

PIN = "schedulefree==1.4.1"  # the schedule-free extra's (pyproject.toml): for the message


def build(groups: list[dict[str, Any]], cfg: Any, device: torch.device) -> torch.optim.Optimizer:
    """AdamWScheduleFree over the groups, at train.lr, train.adam_beta1/beta2 and eps; its own
    warmup off (the schedule's warmup sets lr)."""
    del device  # the foreach step runs wherever the parameters are
    try:
        import schedulefree
    except ImportError:
        raise UserError(
            f"train.optimizer=schedule_free_adamw needs the schedulefree package; accepted: pip install "
            f"'scaletrain[schedule-free]' ({PIN}), or train.optimizer=adamw"
        ) from None
    return schedulefree.AdamWScheduleFree(
        groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, warmup_steps=0
    )
