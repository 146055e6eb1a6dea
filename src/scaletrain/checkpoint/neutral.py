"""A checkpoint's whole state in the engine-neutral layout, read offline from either format.

The layout is Engine.state_dict's: {"model": {name: fp32 tensor}, "optim": {"state.<name>.
exp_avg" | ".exp_avg_sq" | ".step": tensor, "param_groups.<name>.<key>": value}}, full
tensors on CPU, plain parameter names. Any engine loads it (Engine.load_state_dict), which
is how a checkpoint moves to another world size or another engine when the engine cannot
load it natively, and how every such move is verified (checkpoint/restore.py).

* dcp: the torch engines save exactly these keys (engines/torch_engine.py), so the tensors are
  allocated from DCP's metadata and DCP fills them, one process, no process group.
* deepspeed: DeepSpeed's own universal-checkpoint converter (`ds_to_universal`) merges every
  rank's flat partitions into one folder per parameter ({fp32, exp_avg, exp_avg_sq}.pt);
  this module only renames. The converter writes a few files per parameter into a temporary
  directory that is removed afterwards.

Everything is held in memory at once (one full copy of weights and moments): fine for the
models a single host converts; a sharded, streamed path is future work (docs/checkpointing.md).
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from scaletrain.checkpoint.formats import DEEPSPEED_TAG, quiet_single_process, read_stamp
from scaletrain.checkpoint.frozen_base import frozen_left_out
from scaletrain.errors import UserError
from scaletrain.models.params import canonical_name

State = dict[str, dict[str, Any]]


class ParamLayout:
    """Names, shapes and tied aliases of a model's parameters, from its meta-device build:
    what a reader needs where a format stores a tied parameter once or flattens tensors."""

    def __init__(self, model: nn.Module):
        self.shapes: dict[str, torch.Size] = {}
        self.aliases: dict[str, str] = {}  # a tied parameter's later name -> its first name
        self.frozen: set[str] = set()  # no gradient (model.trainable, LoRA's base)
        first: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            name = canonical_name(name)
            self.shapes[name] = p.shape
            if not p.requires_grad:
                self.frozen.add(name)
            if id(p) in first:
                self.aliases[name] = first[id(p)]
            else:
                first[id(p)] = name


def read_state(ckpt: Path, layout: ParamLayout) -> State:
    """The neutral state of the checkpoint directory `ckpt` (a checkpoints/step_<N>)."""
    fmt = read_stamp(ckpt)["format"]
    if fmt == "dcp":
        state = _read_dcp(ckpt / "state")
    elif fmt == "deepspeed":
        state = _read_deepspeed(ckpt / "state", layout)
    else:
        raise UserError(f"checkpoint {ckpt} is in format {fmt!r}, which this version cannot read; accepted: dcp, deepspeed")
    for alias, first in layout.aliases.items():  # tied weights appear under every name, as in state_dict()
        if first in state["model"]:
            state["model"].setdefault(alias, state["model"][first])
    missing = sorted(set(layout.shapes) - set(state["model"]))
    if frozen_left_out(ckpt):  # checkpoint.frozen=reference: those come from the base, as the model is built
        missing = [n for n in missing if n not in layout.frozen]
    if missing:
        raise UserError(f"checkpoint {ckpt} holds no weights for {', '.join(missing[:3])}; accepted: a checkpoint of this model")
    return state


def _read_dcp(state_dir: Path) -> State:
    reader = FileSystemReader(str(state_dir))
    metadata = reader.read_metadata().state_dict_metadata
    flat: dict[str, Any] = {}
    for key, meta in metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata):
            flat[key] = io.BytesIO()  # DCP replaces it with the loaded object
    with quiet_single_process():
        dcp.load(flat, storage_reader=reader, no_dist=True)  # offline, even inside a process group
    state: State = {"model": {}, "optim": {}}
    for key, value in flat.items():
        part, _, rest = key.partition(".")
        if part in state:
            state[part][rest] = value
    return state


def _read_deepspeed(state_dir: Path, layout: ParamLayout) -> State:
    with _universal(state_dir) as zero:
        return _read_universal(zero, layout)


@contextmanager
def _universal(state_dir: Path) -> Iterator[Path]:
    """DeepSpeed's universal form of a ZeRO checkpoint, in a temporary directory: one folder
    per parameter under the yielded `zero/`."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import
    from deepspeed.checkpoint import ds_to_universal

    with tempfile.TemporaryDirectory(prefix="scaletrain-universal-") as tmp:
        out = Path(tmp) / "universal"
        args = argparse.Namespace(
            input_folder=str(state_dir / DEEPSPEED_TAG),
            output_folder=str(out),
            num_extract_workers=1,  # a process pool: more workers only help on many cores
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            # A plain nn.Module checkpoint lacks the Megatron-style metadata it asserts on.
            inject_missing_state=True,
        )
        # It reports progress with print() and tqdm: a library call should not.
        with open(os.devnull, "w") as sink, redirect_stdout(sink), redirect_stderr(sink):
            ds_to_universal.main(args)
        yield out / "zero"


class WeightStream:
    """The model weights of a checkpoint one tensor at a time (for exports whose peak memory
    must stay near the largest tensor): `with WeightStream(ckpt, layout) as w: w.get(name)`.
    `trained` names the parameters that have optimizer state (the ones training updated)."""

    def __init__(self, ckpt: Path, layout: ParamLayout):
        self.ckpt, self.layout = ckpt, layout
        self.format = read_stamp(ckpt)["format"]
        self._stack = ExitStack()
        self.trained: set[str] = set()

    def __enter__(self) -> WeightStream:
        state_dir = self.ckpt / "state"
        if self.format == "dcp":
            self._reader = FileSystemReader(str(state_dir))
            self._meta = self._reader.read_metadata().state_dict_metadata
            self.trained = {k[len("optim.state.") : -len(".exp_avg")] for k in self._meta if k.endswith(".exp_avg")}
        elif self.format == "deepspeed":
            zero = self._stack.enter_context(_universal(state_dir))
            self._folders = {canonical_name(p.name): p for p in zero.iterdir() if p.is_dir()}
            self.trained = {name for name, p in self._folders.items() if (p / "exp_avg.pt").is_file()}
        else:
            raise UserError(f"checkpoint {self.ckpt} is in format {self.format!r}; accepted: dcp, deepspeed")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def holds(self, name: str) -> bool:
        """Whether the checkpoint has weights for `name` (not: a frozen parameter it left out)."""
        name = self.layout.aliases.get(name, name)
        return name in self._folders if self.format == "deepspeed" else f"model.{name}" in self._meta

    def get(self, name: str) -> torch.Tensor:
        """fp32 weights of parameter `name` (a tied alias gives its first name's tensor)."""
        name = self.layout.aliases.get(name, name)
        if self.format == "deepspeed":
            return _universal_tensor(self._folders[name], "fp32", self.layout.shapes[name])
        meta = self._meta[f"model.{name}"]
        assert isinstance(meta, TensorStorageMetadata)
        one = {f"model.{name}": torch.empty(meta.size, dtype=meta.properties.dtype)}
        with quiet_single_process():
            dcp.load(one, storage_reader=self._reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        return one[f"model.{name}"].float()


def _universal_tensor(folder: Path, kind: str, shape: torch.Size) -> torch.Tensor:
    value = torch.load(folder / f"{kind}.pt", map_location="cpu", weights_only=False)
    value = value["param"] if isinstance(value, dict) else value  # ZeRO-1/2: {"param", "cat_dim"}; ZeRO-3: flat 1-D
    return value.detach().float().reshape(shape).contiguous()


def _read_universal(zero: Path, layout: ParamLayout) -> State:
    common = torch.load(zero / "optimizer_state.pt", map_location="cpu", weights_only=False)
    # ZeRO-1/2 write step.pt per parameter; ZeRO-3 keeps one step per group in its optimizer state.
    inner = common.get("optimizer_state_dict", {}).get("state", {})
    group_step = max((int(s["step"]) for s in inner.values() if "step" in s), default=0)
    state: State = {"model": {}, "optim": {}}
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        name = canonical_name(folder.name)
        if name not in layout.shapes:
            raise UserError(
                f"DeepSpeed checkpoint holds {name!r}, which this model does not have; accepted: a checkpoint of this model"
            )
        shape = layout.shapes[name]
        state["model"][name] = _universal_tensor(folder, "fp32", shape)
        if (folder / "exp_avg.pt").is_file():
            for kind in ("exp_avg", "exp_avg_sq"):
                state["optim"][f"state.{name}.{kind}"] = _universal_tensor(folder, kind, shape)
            step = torch.load(folder / "step.pt", weights_only=False) if (folder / "step.pt").is_file() else group_step
            state["optim"][f"state.{name}.step"] = torch.tensor(float(step))
    return state
