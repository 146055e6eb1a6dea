"""The frozen teacher beside the student (model.teacher), built the way each engine
holds its own model, for forward only: no optimizer state, no gradients, no checkpoint.

- ddp, zero1, zero2: a full copy on every rank (as the student's weights are), in the
  dtype the forward computes in, so a frozen copy costs 2 bytes per parameter under bf16;
- fsdp: every block one FSDP unit and the rest one more, resharded after each forward,
  so a rank holds 1/dp of it plus the unit running (engines/fsdp.py);
- zero3: a DeepSpeed engine without an optimizer, which partitions it and gathers each
  module for its forward (engines/deepspeed.py).
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.engines.precision import AUTOCAST_DTYPES
from scaletrain.models.spec import ModelSpec


def teacher_seed(seed: int) -> int:
    """A teacher without weights of its own (an inline or built-in config) is initialized
    from another seed than the student: the same seed would make a same-shaped pair equal."""
    return seed + 1


def frozen_meta(spec: ModelSpec, seq_len: int) -> nn.Module:
    model = spec.build_meta(seq_len)
    model.requires_grad_(False)
    return model.eval()  # dropout, where a Hugging Face config has any, off


def replicated_teacher(spec: ModelSpec, seq_len: int, device: torch.device, seed: int, precision: str) -> nn.Module:
    """The whole teacher on this rank, in the compute dtype (fp32 under precision fp32)."""
    model = frozen_meta(spec, seq_len)
    spec.materialize(model, device, teacher_seed(seed))
    return model.to(AUTOCAST_DTYPES.get(precision, torch.float32))
