"""Which ranks share a disk under run.dir. With checkpoint.dir in object storage, nodes need
not share one.

At start (world > 1) every rank writes a file holding a token of its own under
<run.dir>/checkpoints and reads which of the others' files it sees with their tokens: the
ranks it sees share its disk. A disk is named by its lowest rank, its leader (the rank that
brings checkpoints back from the store onto it and clears it).

When every rank sees every file the disk is shared (rank 0 leads it) and checkpoints are
written there whole, as always. Otherwise each node's directory holds only what its own ranks
wrote, so a checkpoint is whole only in the store: checkpoint.dir is required, each disk's
ranks copy the files their disk holds (checkpoint/remote.py), rank 0 the marker last, and the
local files are removed once copied; a resume brings the store's newest back onto every disk.

SCALETRAIN_NODE_DISKS=<n> (a drill, for tests): the ranks, split into n consecutive nodes,
act as if their disks were not shared: node k > 0 keeps its checkpoints under
<run.dir>/node<k>/checkpoints, as another machine's own disk would hold them.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.launch.distributed import World, barrier, gather_objects

NODE_DISKS_ENV = "SCALETRAIN_NODE_DISKS"


@dataclass(frozen=True)
class Disks:
    of: tuple[int, ...]  # each rank's disk, named by the lowest rank that shares it
    rank: int

    @property
    def shared(self) -> bool:
        return all(d == 0 for d in self.of)

    @property
    def mine(self) -> int:
        return self.of[self.rank]

    @property
    def leader(self) -> bool:
        return self.mine == self.rank

    @property
    def members(self) -> list[int]:
        return [r for r, d in enumerate(self.of) if d == self.mine]


def shared(world: World) -> Disks:
    return Disks((0,) * world.world_size, world.rank)


def checkpoints_root(run_root: Path, world: World) -> Path:
    """<run.dir>/checkpoints, or under the SCALETRAIN_NODE_DISKS drill node k's own directory."""
    value = os.environ.get(NODE_DISKS_ENV, "")
    if not value:
        return run_root / "checkpoints"
    if not value.isdigit() or not 1 <= int(value) <= world.world_size or world.world_size % int(value):
        raise UserError(f"{NODE_DISKS_ENV}={value!r} is invalid; accepted: a number of nodes that divides the world size")
    node = world.rank * int(value) // world.world_size
    return run_root / "checkpoints" if node == 0 else run_root / f"node{node}" / "checkpoints"


def find_disks(root: Path, world: World) -> Disks:
    """Collective: which ranks see the files the others write under `root`."""
    if not world.distributed or world.world_size == 1:
        return shared(world)
    root.mkdir(parents=True, exist_ok=True)
    tokens = gather_objects(world, secrets.token_hex(8))  # this run's: a stale file of another run is no proof
    mine = root / f".disk_rank{world.rank}"
    mine.write_text(tokens[world.rank])
    barrier(world)
    seen = [r for r in range(world.world_size) if _read(root / f".disk_rank{r}") == tokens[r]]
    barrier(world)  # every rank has read before any file goes
    mine.unlink(missing_ok=True)
    return Disks(tuple(gather_objects(world, min(seen))), world.rank)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def check_disks(disks: Disks, store: str | None, run_dir: str) -> None:
    """At start: nodes without a shared disk need the store (one line otherwise)."""
    if disks.shared or store:
        return
    apart = [r for r, d in enumerate(disks.of) if d != 0]
    raise UserError(
        f"ranks {', '.join(map(str, apart))} do not see the files rank 0 writes under run.dir={run_dir} (the nodes "
        f"share no disk: {len(set(disks.of))} disks), so no node could hold a whole checkpoint; accepted: a run.dir "
        "on a disk every node shares, or checkpoint.dir on object storage (s3://bucket/prefix)"
    )
