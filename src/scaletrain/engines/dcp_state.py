"""What the torch-native engines (ddp, fsdp) share: model + optimizer state through
torch.distributed.checkpoint, and the loss-scaled optimizer step.

get_state_dict keys everything by parameter name (wrapper prefixes stripped) and keeps
FSDP2 shards as DTensors, so DCP can reload onto another world size or another torch
engine: the resharding the roadmap builds on.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from scaletrain.engines.base import StepStats


def save_dcp(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load_dcp(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with quiet_single_process():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


class quiet_single_process(warnings.catch_warnings):
    """DCP warns that it assumes a single process when no process group exists: that is intended."""

    def __enter__(self):  # type: ignore[no-untyped-def]
        out = super().__enter__()
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return out


class TorchEngineMixin:
    """Backward, the loss-scaled optimizer step and state handling, shared by the
    torch-native engines (ddp, fsdp).

    Not an engine: each engine still owns its wrapping, precision, accumulation and
    `clip_gradients` (plain tensors for DDP, DTensor shards for FSDP2). Needs `model`,
    `optimizer` and `scaler` (a GradScaler for fp16, else None).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None

    def clip_gradients(self) -> torch.Tensor:
        """Clip (if configured) and return the global gradient norm as a 0-d tensor."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, lr: float) -> StepStats:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.clip_gradients()
        loss_scale, skipped = None, False
        if self.scaler:
            before = self.scaler.get_scale()
            # Skips the update after an overflow; with DTensor gradients the overflow flag is
            # all-reduced, so every rank skips together.
            self.scaler.step(self.optimizer)
            self.scaler.update()
            loss_scale = self.scaler.get_scale()
            skipped = loss_scale < before
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(grad_norm.detach(), loss_scale, skipped)

    def save(self, path: Path) -> None:
        save_dcp(self.model, self.optimizer, path)

    def load(self, path: Path) -> None:
        load_dcp(self.model, self.optimizer, path)

    def extra_state(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler else {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if self.scaler and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])

    def full_weights(self) -> dict[str, torch.Tensor]:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=opts)

    def checkpoint_files(self) -> dict[str, str]:
        return {}
