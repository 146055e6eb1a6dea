"""Checkpoint directories: atomic writes, finding the newest complete one, keeping the last k.

Layout of `checkpoints/step_<N>/`:
  state/            model + optimizer, written by the engine (torch.distributed.checkpoint for
                    ddp/fsdp; DeepSpeed's own format for ZeRO)
  <engine files>    e.g. deepspeed_config.json: the exact engine settings
  trainer.json      the TrainerState (checkpoint/state.py): step, data position (one global
                    sample index), engine extras (loss scaler), the stamp {format, engine},
                    model shape, data fingerprint
  rng_rank<R>.pt    each rank's RNG states (tensors and ints only: loads with weights_only)
  config.yaml       the resolved config that produced it
  COMPLETE          written last, after every rank finished: no marker, no checkpoint. It
                    holds the manifest: every file's size and CRC-32 as saved, so a
                    truncated, emptied, missing or overwritten file is found before a resume
                    trusts it (the ranks hash and check the files between them)
"""

from __future__ import annotations

import json
import random
import re
import shutil
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint.disks import Disks, shared
from scaletrain.checkpoint.state import FILE, TrainerState
from scaletrain.errors import UserError
from scaletrain.files import write_atomic
from scaletrain.launch.distributed import ALONE, World, barrier, gather_objects, side_group
from scaletrain.resilience import faults

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


def latest_valid(root: Path, world: World, report: Callable[[str], None]) -> Path | None:
    """Collective: the newest complete checkpoint whose files are all as saved; each newer
    one that is not gets one `report` line naming what is wrong, and is skipped."""
    for _, path in reversed(complete_checkpoints(root)):
        problem = find_problem(path, world)
        if problem is None:
            return path
        report(f"resume: skipping {path}: {problem}")
    return None


def find_problem(path: Path, world: World, checksums: bool = True) -> str | None:
    """Collective: None if the checkpoint `path` is whole, else what is wrong, in a few words
    (the same on every rank). Sizes are checked by everyone, checksums split between ranks."""
    try:
        marker = json.loads((path / MARKER).read_text())
        files = marker["files"] if isinstance(marker, dict) and "files" in marker else None
    except (OSError, ValueError) as e:
        return f"its {MARKER} marker is unreadable ({type(e).__name__})"
    if files is None:  # written before manifests existed: only completeness is known
        return None
    for rel, (size, _) in sorted(files.items()):
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} is {f.stat().st_size} bytes, {size} when saved"
    if not checksums:
        return None
    mine = sorted(files)[world.rank :: world.world_size]
    bad = [rel for rel in mine if _crc32(path / rel) != files[rel][1]]
    found = sorted(b for part in gather_objects(world, bad) for b in part)
    return f"{found[0]} does not match its checksum (overwritten or corrupted)" if found else None


def save_checkpoint(
    path: Path,
    world: World,
    save_state: Callable[[Path], Future[Any] | None],
    trainer_state: TrainerState,
    files: dict[str, str],
    then: Callable[[], Any] = lambda: None,
    copy: Copy | None = None,
    disks: Disks | None = None,
) -> PendingSave | None:
    """Collective: every rank calls it. The marker appears only once all ranks' data is on disk.

    `save_state(dir)` writes model + optimizer (the engine's job) and may return a future:
    the state is then still being written, and the rest (waiting for it, the manifest, the
    marker, then `then()`, e.g. pruning) runs in a thread of this rank: the PendingSave
    returned, to be waited for before the next save. `files` are small text files rank 0
    writes beside them (resolved config, engine JSON). `copy` (checkpoint.dir) copies the
    checkpoint to object storage once sealed, collectively; `disks` says which ranks share a
    disk (checkpoint/disks.py): without one shared, no local marker is written.
    """
    disks = disks or shared(world)
    if disks.leader and path.exists():
        shutil.rmtree(path)  # a stale, incomplete attempt at the same step (on each disk)
    barrier(world)
    writing = save_state(path / "state")
    path.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), path / f"rng_rank{world.rank}.pt")
    if world.is_main:
        write_atomic(path / FILE, trainer_state.to_json())
        for name, text in files.items():
            write_atomic(path / name, text)
    step = trainer_state.step
    if writing is None:
        _seal(path, world, step, disks, copy)
        then()
        return None
    # The thread's collectives go on a group of their own, beside training's.
    beside = replace(world, group=side_group("checkpoint"))

    def finish() -> None:
        writing.result()
        _seal(path, beside, step, disks, copy)
        then()

    return PendingSave(step, finish)


# What copies a sealed checkpoint to object storage, collectively (checkpoint/remote.py's
# StoreCopy): (the directory, the world, the step, this rank's share of the files, the marker's text).
Copy = Callable[[Path, World, int, list[str], str], None]


def _seal(path: Path, world: World, step: int, disks: Disks, copy: Copy | None) -> None:
    """Collective: once every rank's files are on disk, the manifest and the marker (on the
    local disk when every rank shares it); then the copy to object storage, if any."""
    barrier(world)  # every rank's shard and RNG file exists before the marker
    manifest, mine = _manifest(path, world, disks)
    faults.kill_at("save", step)
    text = json.dumps({"step": step, "files": manifest}, indent=0)
    if world.is_main and disks.shared:
        write_atomic(path / MARKER, text)
    barrier(world)  # returned on one rank: complete for all (verify_on_start reads it next)
    if copy is not None:
        copy(path, world, step, mine, text)


class PendingSave:
    """A checkpoint still being written by a thread of this rank. A daemon thread: a run that
    crashes meanwhile exits without it, leaving the checkpoint without its marker (so
    ignored), as a kill would."""

    def __init__(self, step: int, finish: Callable[[], Any]):
        self.step = step
        self.finished = 0.0  # time.perf_counter() when the marker was written
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(finish,), name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()

    def _run(self, finish: Callable[[], Any]) -> None:
        try:
            finish()
        except BaseException as e:  # handed to the training thread by wait()
            self._error = e
        self.finished = time.perf_counter()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        """Until the writing ended or `timeout_s` passed, whatever it raised."""
        self._thread.join(timeout_s)

    def wait(self) -> None:
        """Until the marker is written; raises what the writing raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def _manifest(path: Path, world: World, disks: Disks) -> tuple[dict[str, list[int]], list[str]]:
    """Collective: {relative path: [bytes, crc32]} of every file under `path` on any disk,
    and this rank's share of them: each file belongs to the lowest disk that holds it, and
    each disk's files are split between its ranks (a checkpoint is mostly its ranks' shards:
    hashing, and copying to a store, scale with them)."""
    here = sorted(f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file() and f.name != MARKER)
    owner: dict[str, int] = {}
    for rank, names in enumerate(gather_objects(world, here)):
        for name in names:
            owner.setdefault(name, disks.of[rank])
    members = disks.members
    mine = [n for n in sorted(owner) if owner[n] == disks.mine][members.index(world.rank) :: len(members)]
    hashed = {rel: [(path / rel).stat().st_size, _crc32(path / rel)] for rel in mine}
    return {rel: entry for part in gather_objects(world, hashed) for rel, entry in part.items()}, mine


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def load_checkpoint(path: Path, world: World, load_state: Callable[[Path], Any]) -> TrainerState:
    """Collective: `load_state(path)` restores model + optimizer (checkpoint/restore.py);
    restore this rank's RNG; return the trainer state."""
    if not is_complete(path):
        raise UserError(
            f"checkpoint {path} is incomplete (no {MARKER} marker: its save was interrupted); "
            "accepted: a complete checkpoints/step_<N> directory, or train.resume=auto"
        )
    load_state(path)
    trainer_state = TrainerState.read(path)
    rng_file = path / f"rng_rank{world.rank}.pt"
    # RNG streams belong to ranks: only restorable when the world size is unchanged.
    if trainer_state.world_size == world.world_size and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return trainer_state


def prune(root: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` whole checkpoints (all files present at their saved sizes);
    delete every older one, complete or not. A damaged checkpoint never counts as kept, so
    the last whole one survives whatever happened to newer ones."""
    whole = [(s, p) for s, p in complete_checkpoints(root) if find_problem(p, ALONE, checksums=False) is None]
    if not whole:
        return []
    oldest_kept = whole[-min(keep, len(whole))][0]
    doomed = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and int(m.group(1)) < oldest_kept:
            doomed.append(p)
    for p in doomed:
        # Remove the marker first: a crash mid-delete leaves an incomplete dir, never a broken "complete" one.
        (p / MARKER).unlink(missing_ok=True)
        faults.kill_at("prune", whole[-1][0])
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
