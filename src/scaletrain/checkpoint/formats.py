"""What a checkpoint's state is, from the stamp in its trainer.json, and reading its weights.

The stamp names the format of `state/` (what the engine's native save wrote) and the
engine that wrote it. Formats are data, engines are code: this module reads both formats
with torch's and DeepSpeed's own readers and never imports an engine.
"""

from __future__ import annotations

import json
import os
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from scaletrain.errors import UserError
from scaletrain.models.params import canonical_name

# What each strategy's native save writes. Engines of one format load each other's state
# (DCP reshards between ddp and fsdp); across formats, conversion is a separate step.
ENGINE_FORMATS = {"ddp": "dcp", "fsdp": "dcp", "zero1": "deepspeed", "zero2": "deepspeed", "zero3": "deepspeed"}
# DeepSpeed writes each checkpoint into <state>/<tag>/; one fixed tag, because our step
# directories already name the step, and no "latest" file: our COMPLETE marker decides.
DEEPSPEED_TAG = "zero"


def read_stamp(path: Path) -> dict[str, str]:
    """{"format", "engine"} of the checkpoint directory `path`."""
    state = json.loads((path / "trainer.json").read_text())
    if "format" not in state or "engine" not in state:
        raise UserError(f"checkpoint {path} has no format stamp (written by an older scaletrain); accepted: a new run.dir")
    return {"format": state["format"], "engine": state["engine"]}


def check_engine(path: Path, strategy: str) -> str | None:
    """None if `strategy` resumes what `path` holds as it is, else a note for the log saying
    how it is carried over (checkpoint/restore.py); a UserError for an unknown format."""
    stamp = read_stamp(path)
    wrote, fmt = stamp["engine"], stamp["format"]
    if fmt not in ENGINE_FORMATS.values():
        raise UserError(f"checkpoint {path} is in format {fmt!r}, which this version cannot read; accepted: dcp, deepspeed")
    if wrote == strategy:
        return None
    if fmt == ENGINE_FORMATS.get(strategy) == "dcp":
        return f"resume: {path.name} was written by {wrote}; {strategy} loads it through torch.distributed.checkpoint"
    return f"resume: {path.name} was written by {wrote} ({fmt} format); converting it to {strategy} on the fly"


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) fp32 model weights of a checkpoint by parameter name, in one
    process, on CPU, whatever the world size it was written with."""
    fmt = read_stamp(path)["format"]
    if fmt == "dcp":
        return _read_dcp_weights(path / "state")
    if fmt == "deepspeed":
        return _read_deepspeed_weights(path / "state")
    raise UserError(f"checkpoint {path} is in format {fmt!r}, which this version cannot read; accepted: dcp, deepspeed")


def _read_dcp_weights(state_dir: Path) -> dict[str, torch.Tensor]:
    # The tensors are allocated from DCP's metadata and DCP fills them from whichever
    # shards hold the pieces.
    reader = FileSystemReader(str(state_dir))
    metadata = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    with quiet_single_process():
        dcp.load(state, storage_reader=reader, no_dist=True)  # offline, even inside a process group
    return {key.removeprefix("model."): t for key, t in state.items()}


def _read_deepspeed_weights(state_dir: Path) -> dict[str, torch.Tensor]:
    # No process group: DeepSpeed's zero_to_fp32 reassembles the fp32 master partitions of
    # every rank from the optimizer-state files. It picks its accelerator at import.
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # It reports progress with print() and tqdm: a library call should not.
    with open(os.devnull, "w") as sink, redirect_stdout(sink), redirect_stderr(sink):
        state = get_fp32_state_dict_from_zero_checkpoint(str(state_dir), tag=DEEPSPEED_TAG)
    return {canonical_name(name): t.float().contiguous() for name, t in state.items()}


class quiet_single_process(warnings.catch_warnings):
    """DCP warns that it assumes a single process when no process group exists: that is intended."""

    def __enter__(self) -> Any:
        out = super().__enter__()
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return out
