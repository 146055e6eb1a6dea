"""`python -m scaletrain.engines.deepspeed_ops`: compile DeepSpeed's CPU ops ahead of time.

DeepSpeed JIT-compiles its C++ ops (the shared-memory comm op, FusedAdam, DeepSpeedCPUAdam,
and async_io for NVMe offload) the first time a run needs them: minutes on a small machine
(async_io with its pin_memory op alone ~3 min on 2 cores), spent inside the first training
run. async_io links libaio and is built only where libaio-dev is installed (`make
setup-test` installs it as root); elsewhere nvme offload is refused with that message. `make setup` calls this once so runs start at full speed; the builds are
cached in TORCH_EXTENSIONS_DIR (inside the virtual environment: launch/env.py's use_build_environment),
by the environment's own ninja, which every later build uses too (also pinned there: a
ninja of another version rejects the build log and rebuilds every op).
On a CUDA machine there is nothing to do here: the CUDA ops are built by DeepSpeed for the
GPU it finds.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path


def clear_stale_locks() -> list[Path]:
    """Remove build locks in TORCH_EXTENSIONS_DIR that no live process holds; return them.

    torch's FileBaton creates `<op>/lock` with O_EXCL and keeps it open until the build ends,
    then deletes it; a build killed in between leaves the file, and every later build of that
    op sleeps on it forever. A lock that no process has open is therefore stale. (Linux: the
    holders are read from /proc; elsewhere nothing is removed.)

    Every load of an op takes its lock for a moment, even when nothing is rebuilt, so with
    runs side by side a lock seen here may be released while /proc is read and the path
    taken by a new build's lock, which the scan did not see open: removing that one made
    its build fail ("No such file ... lock") in CI. So only a lock older than the listing
    is removed: a live one is open from its creation to its removal, so a file that
    existed before the listing and is still there would have been seen open. (The second
    of margin covers file timestamps that lag the clock by a tick.)
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    listed_at = time.time()
    locks = [p.resolve() for p in Path(root).glob("*/lock")] if root else []
    if not locks or not Path("/proc/self/fd").is_dir():
        return []
    held = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            held.add(Path(os.readlink(fd)))
        except OSError:  # the process or descriptor went away, or is not ours to read
            continue
    stale = [lock for lock in locks if lock not in held and _created_before(lock, listed_at - 1.0)]
    for lock in stale:
        lock.unlink(missing_ok=True)
    return stale


def _created_before(path: Path, when: float) -> bool:
    """Whether the file now at `path` was last changed before `when` (False if it is gone)."""
    try:
        return path.stat().st_mtime < when
    except FileNotFoundError:
        return False


def main() -> int:
    import torch

    from scaletrain.launch.env import use_build_environment

    use_build_environment()

    if torch.cuda.is_available():
        print("deepspeed ops: CUDA present, CPU ops not needed")
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for lock in clear_stale_locks():
        print(f"deepspeed ops: removed {lock}, left by a build that was killed")
    from deepspeed.ops.op_builder.cpu import (
        AsyncIOBuilder,
        CPUAdamBuilder,
        FusedAdamBuilder,
        ShareMemCommBuilder,
    )

    builders = [ShareMemCommBuilder, FusedAdamBuilder, CPUAdamBuilder]
    # is_compatible: a test program that links libaio's io_submit compiles (about a second).
    if AsyncIOBuilder().is_compatible():
        builders.append(AsyncIOBuilder)  # its load() builds the pin_memory op it needs first
    else:
        print("deepspeed ops: async_io skipped: libaio not found (Debian: apt-get install libaio-dev); nvme offload unavailable")
    # One op per process, as many at a time as there are cores: each op is one to three
    # source files, which one compiler process builds one after the other, so the ops
    # themselves are what can run side by side. The longest (async_io) first.
    names = [b.__name__ for b in reversed(builders)]
    with ProcessPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1), mp_context=get_context("spawn")) as pool:
        for name, seconds in zip(names, pool.map(_build, names)):
            print(f"deepspeed ops: {name.removesuffix('Builder')} ready ({seconds:.0f} s)")
    # The precompiled headers (launch/compiler.py: ~800 MB each) served these builds; no op's
    # object depends on them, and a later build makes one again if it needs it.
    if os.environ.get("TORCH_EXTENSIONS_DIR"):  # where the wrapper is in use (launch/env.py)
        shutil.rmtree(Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "pch", ignore_errors=True)
    return 0


def _build(name: str) -> float:
    """Build (or find built) DeepSpeed's CPU op `name`; the seconds it took."""
    import deepspeed.ops.op_builder.cpu as builders

    t0 = time.perf_counter()
    getattr(builders, name)().load(verbose=False)
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
