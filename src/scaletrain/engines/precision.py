"""Mixed-precision pieces shared by the torch engines: autocast context and loss scaler."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from scaletrain.config import TrainConfig

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(precision: str, device: torch.device) -> Any:
    # Parameters and optimizer state stay fp32 (master weights); only the forward's
    # matmuls run in the low-precision type.
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def make_loss_scaler(precision: str, device: torch.device, train: TrainConfig) -> torch.amp.GradScaler | None:
    # fp16's narrow exponent range underflows small gradients: scale the loss up and back
    # the scale off on overflow (dynamic loss scaling). bf16 has fp32's range and needs none.
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type, init_scale=train.loss_scale_init, growth_interval=train.loss_scale_window)
