"""Atomic, resumable checkpoints: step directories, their format stamp, resume checks."""

from scaletrain.checkpoint.formats import ENGINE_FORMATS, check_engine, read_model_weights, read_stamp
from scaletrain.checkpoint.manager import (
    MARKER,
    complete_checkpoints,
    is_complete,
    latest_complete,
    load_checkpoint,
    prune,
    save_checkpoint,
    step_dir,
    write_atomic,
)

__all__ = [
    "ENGINE_FORMATS",
    "MARKER",
    "check_engine",
    "complete_checkpoints",
    "is_complete",
    "latest_complete",
    "load_checkpoint",
    "prune",
    "read_model_weights",
    "read_stamp",
    "save_checkpoint",
    "step_dir",
    "write_atomic",
]
