"""What a checkpoint's state is, from the stamp in its trainer.json, and its offline readers.

The stamp names the format of `state/` (what the engine's native save wrote) and the
strategy that wrote it. Formats are data (strategies.FORMATS), engines are code: each
format has a reader module here (dcp_format.py, deepspeed_format.py) using torch's and
DeepSpeed's own tools, and this package never imports an engine.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import torch

from scaletrain.checkpoint.dcp_format import DcpFormat
from scaletrain.checkpoint.deepspeed_format import DeepSpeedFormat
from scaletrain.checkpoint.layout import ParamLayout, State
from scaletrain.checkpoint.state import TrainerState
from scaletrain.errors import UserError
from scaletrain.strategies import FORMATS, TABLE


class Tensors(Protocol):
    """A checkpoint's weights one tensor at a time, by first name (not a tied alias)."""

    trained: set[str]  # the parameters that have optimizer state (the ones training updated)

    def holds(self, name: str) -> bool: ...
    def get(self, name: str) -> torch.Tensor: ...


class FormatReader(Protocol):
    name: str

    def read_state(self, state_dir: Path, layout: ParamLayout) -> State: ...
    def read_weights(self, state_dir: Path) -> dict[str, torch.Tensor]: ...
    def open(self, state_dir: Path, layout: ParamLayout, stack: ExitStack) -> Tensors: ...


READERS: dict[str, FormatReader] = {r.name: r for r in (DcpFormat(), DeepSpeedFormat())}
assert READERS.keys() == FORMATS.keys(), "every format of the strategy table has a reader, and only those"


def read_stamp(path: Path) -> dict[str, str]:
    """{"format", "engine"} of the checkpoint directory `path`."""
    state = TrainerState.read(path)
    return {"format": state.format, "engine": state.engine}


def reader_of(path: Path) -> FormatReader:
    """The reader of the checkpoint directory `path`'s format; a one-line UserError for a
    format this version cannot read."""
    fmt = read_stamp(path)["format"]
    if fmt not in READERS:
        raise UserError(f"checkpoint {path} is in format {fmt!r}, which this version cannot read; accepted: {', '.join(READERS)}")
    return READERS[fmt]


def check_engine(path: Path, strategy: str) -> str | None:
    """None if `strategy` resumes what `path` holds as it is, else a note for the log saying
    how it is carried over (checkpoint/restore.py); a UserError for an unknown format."""
    reader_of(path)
    stamp = read_stamp(path)
    wrote, fmt = stamp["engine"], stamp["format"]
    if wrote == strategy:
        return None
    if fmt == TABLE[strategy].format and FORMATS[fmt].reshards:
        return f"resume: {path.name} was written by {wrote}; {strategy} loads it through {FORMATS[fmt].reader}"
    return f"resume: {path.name} was written by {wrote} ({fmt} format); converting it to {strategy} on the fly"


def read_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) fp32 model weights of a checkpoint by parameter name, in one
    process, on CPU, whatever the world size it was written with."""
    return reader_of(path).read_weights(path / "state")
