"""Loading a checkpoint into a live engine: natively when it can, through the neutral state
when it must, and verified whenever the layout changed.

* Same engine, same world size: the engine's native load (bit-exact resume, tested).
* Torch format (dcp) into a torch engine at another world size, or ddp <-> fsdp: DCP's
  native load, which reshards (each rank reads only the byte ranges of its own shards).
* Anything else (DeepSpeed at another data-parallel size, DeepSpeed <-> torch): the
  checkpoint is read offline into the neutral state (checkpoint/neutral.py) and handed to
  Engine.load_state_dict.

A resharded or converted resume then verifies itself: the engine's own state, gathered
back (Engine.state_dict), must equal what the checkpoint holds, tensor for tensor,
bit for bit (moving shards around and converting layouts does no arithmetic). A mismatch
is a one-line refusal naming the tensor: a silent wrong resume costs more than a stop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from scaletrain.checkpoint.manager import load_checkpoint
from scaletrain.checkpoint.neutral import ParamLayout, State, read_state
from scaletrain.checkpoint.state import TrainerState
from scaletrain.errors import UserError
from scaletrain.launch.distributed import World, broadcast_object
from scaletrain.strategies import FORMATS


class Restorable(Protocol):
    """What restoring needs of an engine (engines.base.Engine has it)."""

    name: str
    format: str

    def load(self, path: Path) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def how_to_load(ckpt: Path, engine_name: str, engine_format: str, parallel: dict[str, Any]) -> str:
    """ "native" | "resharded" (native load, another layout) | "converted" (through the neutral state).
    `parallel`: the live layout (ParallelDims.as_dict()), compared with the saved one."""
    saved = TrainerState.read(ckpt)
    if saved.engine == engine_name and saved.parallel == parallel:
        return "native"
    if saved.format == engine_format and FORMATS[engine_format].reshards:
        return "resharded"
    return "converted"


def resume_state(
    ckpt: Path, world: World, engine: Restorable, layout: ParamLayout, parallel: dict[str, Any]
) -> tuple[TrainerState, str]:
    """Collective: restore `ckpt` into `engine` (weights, optimizer, this rank's RNG);
    returns the saved trainer state and how the state was loaded."""
    how = ""

    def load(path: Path) -> None:
        nonlocal how
        how = restore(path, world, engine, layout, parallel)

    return load_checkpoint(ckpt, world, load), how


def restore(ckpt: Path, world: World, engine: Restorable, layout: ParamLayout, parallel: dict[str, Any]) -> str:
    """Collective: load `ckpt` (a step directory) into `engine` running the layout
    `parallel`; returns how it was loaded (see how_to_load)."""
    how = how_to_load(ckpt, engine.name, engine.format, parallel)
    if how in ("native", "resharded"):
        engine.load(ckpt / "state")
        saved = None
    else:
        saved = read_state(ckpt, layout)  # every rank reads it: load_state_dict cuts each rank's part
        engine.load_state_dict(saved)
    if how != "native":
        verify(ckpt, world, engine, layout, saved)
    return how


def verify(ckpt: Path, world: World, engine: Restorable, layout: ParamLayout, saved: State | None = None) -> None:
    """Collective: refuse (UserError on every rank) unless the engine holds exactly what `ckpt` does."""
    live = engine.state_dict()  # collective: full tensors on every rank
    problem = None
    if world.is_main:
        problem = first_difference(live, saved if saved is not None else read_state(ckpt, layout))
    problem = broadcast_object(world, problem)
    if problem:
        raise UserError(
            f"resuming {ckpt} on {engine.name} at world size {world.world_size} did not restore it exactly: {problem}; "
            "accepted: resume with the engine and world size that wrote it, and report this as a bug"
        )


def first_difference(live: State, saved: State) -> str | None:
    """None if every weight and optimizer tensor of `saved` is in `live`, bit for bit."""
    for part in ("model", "optim"):
        for key, want in saved[part].items():
            if not isinstance(want, torch.Tensor) or (part == "optim" and not key.startswith("state.")):
                continue
            got = live[part].get(key)
            if got is None:
                return f"{part} {key} is missing"
            got = got.to(want.dtype)
            if got.shape != want.shape:
                return f"{part} {key} has shape {tuple(got.shape)}, the checkpoint {tuple(want.shape)}"
            if key.endswith(".step"):  # one number: torch keeps a tensor per parameter, DeepSpeed one per group
                if float(got) != float(want):
                    return f"optimizer step of {key[6:-5]} is {float(got):g}, the checkpoint {float(want):g}"
            elif not torch.equal(got, want):
                bad = (got != want).sum().item()
                diff = (got.double() - want.double()).abs().max().item()
                return f"{part} {key} differs in {bad} of {want.numel()} elements (max {diff:.3g})"
    return None
