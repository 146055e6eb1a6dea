"""checkpoint.dir as a URL (s3://bucket/prefix, any fsspec URL): every checkpoint copied to
object storage, and a run resumed from there on a machine that has none of them.

Each checkpoint is written to the local disk first by every engine as without a URL (its
own files, the manifest with sizes and CRC-32s), then copied by all ranks together
(StoreCopy): each rank copies its share of the files its disk holds (the share it hashed
for the manifest), then rank 0 writes the marker, the manifest, last, so a copy killed
midway has no marker and is no checkpoint there either (the newest-complete rule is the
same on both sides). With checkpoint.async_save the copy runs in the save's background
thread; each file's upload is retried as data/remote.py's reads are. Then the store keeps
the newest checkpoint.keep complete checkpoints, as the local directory does.

Where the nodes share a disk (checkpoint/disks.py) the local checkpoint is whole and
marked before the copy, as always. Where they do not, each node's disk holds only its own
ranks' files: the store's copy is the checkpoint, and the local files go once copied.

At start (train.resume=auto), the newest complete checkpoint in the store that is newer
than the newest local one is brought back onto each disk (into a temporary directory,
renamed when whole) and checked against its manifest; a damaged one is reported and the
next older one tried. The resume then goes on from the local directory as always, so
resharding to another world size or engine needs nothing more.

Not yet: DCP writing to the store directly (torch's fsspec writer) instead of the local copy.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from scaletrain.checkpoint.manager import MARKER, find_problem, latest_complete, step_dir
from scaletrain.data.remote import open_store, retried
from scaletrain.errors import UserError
from scaletrain.launch.distributed import ALONE, World, barrier, gather_objects
from scaletrain.resilience import faults

_STEP = re.compile(r"^step_(\d+)$")


class CheckpointStore:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = open_store(self.url, "checkpoint.dir")

    def complete(self) -> list[int]:
        """Steps of the complete checkpoints in the store, oldest first."""
        self.fs.invalidate_cache()  # fsspec caches listings: another process (or run) may have written since
        try:
            entries = retried(lambda: self.fs.ls(self.root, detail=False), f"listing {self.url}")
        except Exception as e:  # noqa: BLE001  # an empty prefix: nothing there yet
            if "not there" in str(e):
                return []
            raise
        steps = sorted(int(m.group(1)) for e in entries if (m := _STEP.match(str(e).rstrip("/").rsplit("/", 1)[-1])))
        return [s for s in steps if retried(partial(self.fs.exists, f"{self.root}/step_{s}/{MARKER}"), f"{self.url}/step_{s}")]

    def upload(self, local: Path, name: str | None = None, last: str = MARKER) -> None:
        """A complete local directory copied under `name` (its own by default), the file
        `last` (a checkpoint's marker) written after every other one."""
        name = name or local.name
        files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != last)
        for f in [*files, local / last]:
            rel = f.relative_to(local).as_posix()
            retried(partial(self.fs.put_file, str(f), f"{self.root}/{name}/{rel}"), f"writing {self.url}/{name}/{rel}")

    def prune(self, keep: int) -> None:
        """The store keeps its newest `keep` complete checkpoints; older ones (and incomplete
        ones older than the newest complete) are removed."""
        done = self.complete()
        if not done:
            return
        kept = set(done[-keep:])
        entries = retried(lambda: self.fs.ls(self.root, detail=False), f"listing {self.url}")
        for e in entries:
            m = _STEP.match(str(e).rstrip("/").rsplit("/", 1)[-1])
            if m and int(m.group(1)) not in kept and int(m.group(1)) < done[-1]:
                self.remove(f"step_{m.group(1)}")

    def download(self, step: int, local_root: Path) -> Path:
        """The store's step_<step> as <local_root>/step_<step>, whole or not at all."""
        return self.fetch(f"step_{step}", step_dir(local_root, step))

    def fetch(self, name: str, target: Path) -> Path:
        """The store's directory `name` as `target` (replaced), whole or not at all: into a
        temporary directory beside it, its marker last, renamed when whole."""
        tmp = target.with_name(f".{target.name}.download")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        source = f"{self.root}/{name}"
        names = retried(partial(self.fs.find, source), f"listing {self.url}/{name}")
        for found in sorted(names, key=lambda n: n.endswith(MARKER)):  # the marker last
            rel = str(found)[len(source) + 1 :]
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            retried(partial(self.fs.get_file, found, str(tmp / rel)), f"reading {self.url}/{name}/{rel}")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return target

    def remove(self, name: str) -> None:
        retried(partial(self.fs.rm, f"{self.root}/{name}", recursive=True), f"removing {self.url}/{name}")


def check_store(url: str) -> None:
    """At start, on every rank: the store's bucket is there and the credentials may list it
    (one line otherwise, before any step, not at the first save)."""
    store = CheckpointStore(url)
    bucket = store.root.split("/", 1)[0]
    try:
        retried(partial(store.fs.ls, bucket), f"checkpoint.dir={url}")
    except UserError as e:
        if "not there" not in str(e):
            raise
        raise UserError(f"checkpoint.dir={url}: its bucket {bucket!r} does not exist; accepted: an existing bucket") from None


def bring_back(url: str, local_root: Path, report: Callable[[str], None]) -> Path | None:
    """Each disk's leader (checkpoint/disks.py): the store's newest complete checkpoint newer than
    the newest complete one in `local_root`, downloaded and checked (each damaged one
    reported, removed and the next older tried); None if the local one is as new."""
    store = CheckpointStore(url)
    local = latest_complete(local_root)
    have = int(local.name.split("_")[1]) if local is not None else -1
    for step in reversed(store.complete()):
        if step <= have:
            return None
        path = store.download(step, local_root)
        problem = find_problem(path, ALONE)
        if problem is None:
            report(f"resume: step {step} brought back from {url}")
            return path
        report(f"resume: skipping {url}/step_{step}: {problem}")
        shutil.rmtree(path)
    return None


class StoreCopy:
    """Collective, once a checkpoint is sealed (checkpoint/manager.py's Copy): each rank
    copies its share of the files its disk holds, then rank 0 writes the marker (the
    manifest) last and keeps checkpoint.keep in the store. A copy that still fails after the
    retries is reported in one line and training goes on: the store keeps its newest complete
    checkpoint, and the next save is copied again."""

    def __init__(self, url: str, keep: int, report: Callable[[str], None]):
        self.store = CheckpointStore(url)
        self.keep = keep
        self.report = report

    def __call__(self, path: Path, world: World, step: int, mine: list[str], marker: str) -> None:
        where = f"{self.store.root}/{path.name}"
        slow = faults.slowdown("upload")  # a drill: a slow link to the store
        error = None
        try:
            for rel in mine:
                time.sleep(slow)
                retried(
                    partial(self.store.fs.put_file, str(path / rel), f"{where}/{rel}"),
                    f"writing {self.store.url}/{path.name}/{rel}",
                )
        except Exception as e:  # noqa: BLE001  # any failure is this rank's answer: none may leave the others waiting
            error = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
        errors = [e for e in gather_objects(world, error) if e]
        faults.kill_at("upload", step)
        if world.is_main:
            self._seal(path.name, marker, errors)
        barrier(world)  # returned on one rank: in the store for all (verify_on_start reads it back next)

    def _seal(self, name: str, marker: str, errors: list[str]) -> None:
        """Rank 0: the marker once every rank's share is there, then keep-k; or the warning."""
        try:
            if not errors:
                where = f"{self.store.root}/{name}/{MARKER}"
                retried(partial(self.store.fs.pipe_file, where, marker.encode()), f"writing {self.store.url}/{name}/{MARKER}")
                self.store.prune(self.keep)
        except Exception as e:  # noqa: BLE001  # reported; the other ranks wait at the barrier after it
            errors = [str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"]
        if errors:
            self.report(
                f"warning: checkpoint {name} was not copied to {self.store.url} ({errors[0]}); the store's newest "
                "complete checkpoint is an older one, and the next save is copied again"
            )


def same_everywhere(local_root: Path, world: World) -> None:
    """Collective, where the nodes share no disk, after the bring-back: every disk holds the
    same newest checkpoint (one line otherwise, rather than a resume whose ranks disagree)."""
    newest = latest_complete(local_root)
    names = gather_objects(world, newest.name if newest is not None else None)
    if len(set(names)) > 1:
        raise UserError(
            f"the ranks' disks hold different newest checkpoints after bringing back from the store ({names}, by rank); "
            "accepted: run.dir/checkpoints empty on every node, or one disk every node shares"
        )


def clear_copied(local_root: Path, step: int) -> None:
    """A disk's leader, where the nodes share no disk, once checkpoint `step` is copied (or
    failed to be): its part of it, and any older checkpoint on this disk (one brought back
    at the start), go; the store holds the checkpoints."""
    for p in local_root.glob("step_*"):
        m = _STEP.match(p.name)
        if m and int(m.group(1)) <= step:
            shutil.rmtree(p, ignore_errors=True)
