"""Atomic, resumable checkpoints: step directories, their format stamp, resume checks,
resharding and conversion between engines."""

from scaletrain.checkpoint.formats import check_engine, read_model_weights, read_stamp
from scaletrain.checkpoint.manager import (
    MARKER,
    complete_checkpoints,
    find_problem,
    is_complete,
    latest_complete,
    latest_valid,
    load_checkpoint,
    prune,
    save_checkpoint,
    step_dir,
    write_atomic,
)
from scaletrain.checkpoint.restore import resume_state, verify
from scaletrain.checkpoint.state import TrainerState

__all__ = [
    "MARKER",
    "check_engine",
    "complete_checkpoints",
    "find_problem",
    "is_complete",
    "latest_complete",
    "latest_valid",
    "load_checkpoint",
    "prune",
    "read_model_weights",
    "read_stamp",
    "resume_state",
    "TrainerState",
    "verify",
    "save_checkpoint",
    "step_dir",
    "write_atomic",
]
