"""Checkpoint directories: atomic writes, finding the newest complete one, keeping the last k.

Layout of `checkpoints/step_<N>/`:
  state/            model + optimizer, written by the engine (torch.distributed.checkpoint for
                    ddp/fsdp; DeepSpeed's own format for ZeRO)
  <engine files>    e.g. deepspeed_config.json: the exact engine settings
  trainer.json      step, data position (one global sample index), engine extras (loss scaler),
                    the stamp {format, engine} (checkpoint/formats.py), model shape, data fingerprint
  rng_rank<R>.pt    each rank's RNG states (tensors and ints only: loads with weights_only)
  config.yaml       the resolved config that produced it
  COMPLETE          written last, after every rank finished: no marker, no checkpoint
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from scaletrain import faults
from scaletrain.distributed import World, barrier
from scaletrain.errors import UserError

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_complete(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


def save_checkpoint(
    path: Path,
    world: World,
    save_state: Callable[[Path], None],
    trainer_state: dict[str, Any],
    files: dict[str, str],
) -> None:
    """Collective: every rank calls it. The marker appears only once all ranks' data is on disk.

    `save_state(dir)` writes model + optimizer (the engine's job); `files` are small text
    files rank 0 writes beside them (resolved config, engine JSON).
    """
    if world.is_main and path.exists():
        shutil.rmtree(path)  # a stale, incomplete attempt at the same step
    barrier(world)
    save_state(path / "state")
    path.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), path / f"rng_rank{world.rank}.pt")
    if world.is_main:
        write_atomic(path / "trainer.json", json.dumps(trainer_state, indent=1))
        for name, text in files.items():
            write_atomic(path / name, text)
    barrier(world)  # every rank's shard and RNG file exists before the marker
    faults.kill_at("save", trainer_state["step"])
    if world.is_main:
        write_atomic(path / MARKER, json.dumps({"step": trainer_state["step"]}))


def load_checkpoint(path: Path, world: World, load_state: Callable[[Path], None]) -> dict[str, Any]:
    """Collective: `load_state(dir)` restores model + optimizer; restore this rank's RNG; return trainer state."""
    if not is_complete(path):
        raise UserError(
            f"checkpoint {path} is incomplete (no {MARKER} marker: its save was interrupted); "
            "accepted: a complete checkpoints/step_<N> directory, or train.resume=auto"
        )
    load_state(path / "state")
    trainer_state = json.loads((path / "trainer.json").read_text())
    rng_file = path / f"rng_rank{world.rank}.pt"
    # RNG streams belong to ranks: only restorable when the world size is unchanged.
    if trainer_state.get("world_size") == world.world_size and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return trainer_state


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, and incomplete ones older than those."""
    done = complete_checkpoints(root)
    doomed = [p for _, p in done[:-keep]] if len(done) > keep else []
    if done:
        newest_kept = done[-min(keep, len(done))][0]
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and not is_complete(p) and int(m.group(1)) < newest_kept:
                doomed.append(p)
    for p in doomed:
        # Remove the marker first: a crash mid-delete leaves an incomplete dir, never a broken "complete" one.
        (p / MARKER).unlink(missing_ok=True)
        faults.kill_at("prune", done[-1][0])
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
