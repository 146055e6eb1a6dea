"""Activation checkpointing per transformer block, shared by the torch engines."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    checkpoint_wrapper,
)


def apply_activation_checkpointing(blocks: nn.Module) -> None:
    """Recompute each block's forward during backward instead of keeping its activations.

    Apply before any sharding so a recomputed forward goes through the engine's hooks
    again. The wrapper adds `_checkpoint_wrapped_module` to parameter names; init and
    get_state_dict both strip it, so checkpoints keep plain names.
    """
    for name, block in list(blocks.named_children()):  # a ModuleList's or a ModuleDict's
        setattr(blocks, name, checkpoint_wrapper(block))


def plain_name(name: str) -> str:
    """A parameter name without the wrapper's part, as in an unwrapped model.

    torch's get_state_dict strips it already; DeepSpeed's own state readers do not.
    """
    return name.replace(_CHECKPOINT_PREFIX, "")
