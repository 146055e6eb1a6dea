"""The one protocol every engine implements; the trainer talks to nothing else.

Each engine module owns its quirks (wrapping, precision policy, when gradients are
synchronised, who clips, how state is gathered). No engine inherits from another.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


@dataclass
class StepStats:
    grad_norm: torch.Tensor  # 0-d, stays on device: the trainer syncs once per log interval
    loss_scale: float | None  # fp16 dynamic loss scale after this step; None without scaling
    skipped: bool  # the optimizer step was skipped (fp16 overflow)


class Engine(Protocol):
    model: nn.Module  # what the trainer calls forward on (possibly a wrapper)

    def accumulate(self, boundary: bool) -> AbstractContextManager[Any]:
        """Context for one micro-batch's forward+backward; gradients sync only at the boundary."""

    def autocast(self) -> AbstractContextManager[Any]:
        """Forward-pass precision context."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, lr: float) -> StepStats:
        """Unscale, clip, optimizer step at `lr`, zero gradients."""

    def state_dict(self) -> dict[str, Any]:
        """{"model": ..., "optim": ...} keyed by parameter name, for torch.distributed.checkpoint."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def extra_state(self) -> dict[str, Any]:
        """Small JSON-able engine state outside model/optimizer (e.g. the loss scaler)."""

    def load_extra_state(self, state: dict[str, Any]) -> None: ...

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Unsharded model weights on CPU by parameter name (export, equivalence tests)."""
