"""Atomic, resumable checkpoints (torch.distributed.checkpoint underneath)."""

from scaletrain.checkpoint.manager import (
    MARKER,
    complete_checkpoints,
    is_complete,
    latest_complete,
    load_checkpoint,
    prune,
    read_model_weights,
    save_checkpoint,
    step_dir,
    write_atomic,
)

__all__ = [
    "MARKER",
    "complete_checkpoints",
    "is_complete",
    "latest_complete",
    "load_checkpoint",
    "prune",
    "read_model_weights",
    "save_checkpoint",
    "step_dir",
    "write_atomic",
]
