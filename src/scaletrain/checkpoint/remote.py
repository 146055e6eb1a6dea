"""checkpoint.dir as a URL (s3://bucket/prefix, any fsspec URL): every checkpoint copied to
object storage, and a run resumed from there on a machine that has none of them.

Each checkpoint is written locally first, exactly as without a URL (<run.dir>/checkpoints:
every engine's own files, the manifest with sizes and CRC-32s, the COMPLETE marker), then
copied by rank 0 once it is complete: every file but the marker, then the marker last, so
a copy killed midway has no marker and is no checkpoint there either (the newest-complete
rule is the same on both sides). With checkpoint.async_save the copy runs in the save's
background thread; each file's upload is retried as data/remote.py's reads are. Then the
store keeps the newest checkpoint.keep complete checkpoints, as the local directory does.

At start (train.resume=auto), the newest complete checkpoint in the store that is newer
than the newest local one is brought back into <run.dir>/checkpoints (into a temporary
directory, renamed when whole) and checked against its manifest; a damaged one is
reported and the next older one tried. The resume then goes on from the local directory
as always, so resharding to another world size or engine needs nothing more.

Not yet: nodes without a shared local disk (rank 0 copies what its disk holds; on several
nodes each node's ranks write their own files), DCP writing to the store directly
without the local copy.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from scaletrain.checkpoint.manager import MARKER, find_problem, step_dir
from scaletrain.data.remote import open_store, retried
from scaletrain.launch.distributed import ALONE

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
                retried(
                    partial(self.fs.rm, f"{self.root}/step_{m.group(1)}", recursive=True),
                    f"removing {self.url}/step_{m.group(1)}",
                )

    def download(self, step: int, local_root: Path) -> Path:
        """The store's step_<step> as <local_root>/step_<step>, whole or not at all."""
        target = step_dir(local_root, step)
        tmp = local_root / f".step_{step}.download"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        source = f"{self.root}/step_{step}"
        names = retried(partial(self.fs.find, source), f"listing {self.url}/step_{step}")
        for name in sorted(names, key=lambda n: n.endswith(MARKER)):  # the marker last
            rel = str(name)[len(source) + 1 :]
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            retried(partial(self.fs.get_file, name, str(tmp / rel)), f"reading {self.url}/step_{step}/{rel}")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return target


def check_store(url: str) -> None:
    """At start, on every rank: the store's bucket is there and the credentials may list it
    (one line otherwise, before any step, not at the first save)."""
    from scaletrain.errors import UserError

    store = CheckpointStore(url)
    bucket = store.root.split("/", 1)[0]
    try:
        retried(partial(store.fs.ls, bucket), f"checkpoint.dir={url}")
    except UserError as e:
        if "not there" not in str(e):
            raise
        raise UserError(f"checkpoint.dir={url}: its bucket {bucket!r} does not exist; accepted: an existing bucket") from None


def bring_back(url: str, local_root: Path, report: Callable[[str], None]) -> Path | None:
    """Rank 0 (one process per machine): the store's newest complete checkpoint newer than
    the newest complete one in `local_root`, downloaded and checked (each damaged one
    reported, removed and the next older tried); None if the local one is as new."""
    from scaletrain.checkpoint.manager import latest_complete

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


def after_save(url: str | None, keep: int) -> Callable[[Path], Any]:
    """What rank 0 does with a complete checkpoint: copy it to the store and keep-k there."""
    if not url:
        return lambda path: None
    store = CheckpointStore(url)

    def copy(path: Path) -> None:
        store.upload(path)
        store.prune(keep)

    return copy
