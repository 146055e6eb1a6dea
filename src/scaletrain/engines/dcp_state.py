"""Model + optimizer state through torch.distributed.checkpoint, for the torch-native engines.

get_state_dict keys everything by parameter name (wrapper prefixes stripped) and keeps
FSDP2 shards as DTensors, so DCP can reload onto another world size or another torch
engine: the resharding the roadmap builds on.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


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
