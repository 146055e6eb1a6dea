"""The one protocol every engine implements; the trainer talks to nothing else.

Each engine module owns its quirks (wrapping, precision policy, when gradients are
synchronised, who clips, how state is saved). No engine inherits from another.

An engine is built from a model on the meta device plus a `Materialize` callback, so it
decides the order itself: DDP allocates then wraps; FSDP2 shards then allocates only its
shard; DeepSpeed allocates then hands the module to deepspeed.initialize.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import nn

Materialize = Callable[[nn.Module, torch.device], None]


@dataclass
class StepStats:
    grad_norm: torch.Tensor  # 0-d, stays on device: the trainer syncs once per log interval
    loss_scale: float | None  # fp16 dynamic loss scale after this step; None without scaling
    skipped: bool  # the optimizer step was skipped (fp16 overflow)


class Engine(Protocol):
    name: str
    model: nn.Module  # what the trainer calls forward on (possibly a wrapper)

    def accumulate(self, boundary: bool) -> AbstractContextManager[Any]:
        """Context for one micro-batch's forward+backward; gradients sync only at the boundary."""

    def autocast(self) -> AbstractContextManager[Any]:
        """Forward-pass precision context."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a loss already divided by the number of micro-batches in the step."""

    def step(self, lr: float) -> StepStats:
        """Unscale, clip, optimizer step at `lr`, zero gradients."""

    def save(self, path: Path) -> None:
        """Collective: write model + optimizer state into directory `path` (created by the engine)."""

    def load(self, path: Path) -> None:
        """Collective: restore what `save` wrote (on any world size the engine supports)."""

    def extra_state(self) -> dict[str, Any]:
        """Small JSON-able engine state outside model/optimizer (e.g. the loss scaler)."""

    def load_extra_state(self, state: dict[str, Any]) -> None: ...

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Collective: unsharded model weights on CPU by parameter name (export, tests)."""

    def checkpoint_files(self) -> dict[str, str]:
        """Extra text files to write beside every checkpoint (name -> content), e.g. the DeepSpeed JSON."""
