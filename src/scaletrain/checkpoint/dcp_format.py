"""Reading the torch engines' native checkpoints (torch.distributed.checkpoint) offline.

The torch engines save exactly the neutral state's keys (engines/torch_engine.py:
"model.<name>", "optim.state.<name>.exp_avg", ...), so tensors are allocated from DCP's
metadata and DCP fills them from whichever shards hold the pieces: one process, no
process group, any world size the checkpoint was written with.
"""

from __future__ import annotations

import io
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from scaletrain.checkpoint.layout import ParamLayout, State

# Without a process group (one process: DDP at world 1, and every offline read here) DCP
# warns at each save and load, also from async_save's writer thread, that it assumes a
# single process. That is the intent; the warning would greet every user of `make demo`.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class DcpFormat:
    name = "dcp"

    def read_state(self, state_dir: Path, layout: ParamLayout) -> State:
        reader = FileSystemReader(str(state_dir))
        flat: dict[str, Any] = {}
        for key, meta in reader.read_metadata().state_dict_metadata.items():
            if isinstance(meta, TensorStorageMetadata):
                flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
            elif isinstance(meta, BytesStorageMetadata):
                flat[key] = io.BytesIO()  # DCP replaces it with the loaded object
        dcp.load(flat, storage_reader=reader, no_dist=True)  # offline, even inside a process group
        state: State = {"model": {}, "optim": {}}
        for key, value in flat.items():
            part, _, rest = key.partition(".")
            if part in state:
                state[part][rest] = value
        return state

    def read_weights(self, state_dir: Path) -> dict[str, torch.Tensor]:
        reader = FileSystemReader(str(state_dir))
        metadata = reader.read_metadata().state_dict_metadata
        state = {
            key: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in metadata.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
        }
        dcp.load(state, storage_reader=reader, no_dist=True)
        return {key.removeprefix("model."): t for key, t in state.items()}

    def open(self, state_dir: Path, layout: ParamLayout, stack: ExitStack) -> DcpTensors:
        return DcpTensors(FileSystemReader(str(state_dir)))


class DcpTensors:
    """One tensor at a time from a DCP checkpoint (checkpoint/neutral.py's WeightStream)."""

    def __init__(self, reader: FileSystemReader):
        self._reader = reader
        self._meta = reader.read_metadata().state_dict_metadata
        # A parameter is trained where the optimizer holds state for it, whatever that state's
        # names are (AdamW's exp_avg, Muon's momentum_buffer, schedule-free's z): the key's
        # last part is the state's name, the rest the parameter's.
        self.trained = {k[len("optim.state.") :].rsplit(".", 1)[0] for k in self._meta if k.startswith("optim.state.")}

    def holds(self, name: str) -> bool:
        return f"model.{name}" in self._meta

    def get(self, name: str) -> torch.Tensor:
        meta = self._meta[f"model.{name}"]
        assert isinstance(meta, TensorStorageMetadata)
        one = {f"model.{name}": torch.empty(meta.size, dtype=meta.properties.dtype)}
        dcp.load(one, storage_reader=self._reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        return one[f"model.{name}"].float()
