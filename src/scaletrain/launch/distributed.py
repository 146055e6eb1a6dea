"""Process-group set-up from the launcher's environment, and the few rank helpers we need.

torchrun (and the deepspeed launcher) export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; a plain `scaletrain train` has none of them and runs as a world of one with
no process group at all, so single-process runs pay nothing for distribution.
"""

from __future__ import annotations

import atexit
import os
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from scaletrain.errors import UserError

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: single process, no process group
    # The group the helpers below use: None is the default (training's) group; a thread
    # beside training uses a group of its own (side_group).
    group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


# A world of one process on the CPU, no process group: offline tools (`scaletrain ckpt`)
# and checks one process makes by itself.
ALONE = World(0, 1, 0, torch.device("cpu"), None)


def uses_cuda(device_choice: str) -> bool:
    """run.device: cuda, or auto where a CUDA device is visible."""
    return device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())


def init_distributed(device_choice: str = "auto", backend_choice: str = "auto", timeout_s: float = 600) -> World:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    if device_choice == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device=cuda but no CUDA device is visible; accepted here: auto or cpu")
    use_cuda = uses_cuda(device_choice)
    if use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    backend = backend_choice if backend_choice != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise UserError(
            "parallel.backend=nccl needs CUDA devices and this run has none; accepted on CPU: parallel.backend=gloo or auto"
        )
    global _OWN_GROUP
    if dist.is_initialized() and dist.get_world_size() > 1:
        # A group the caller made (a program that calls scaletrain.train): used as it is, its
        # ranks as it numbers them, and left alone at the end (shutdown).
        return World(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())
    if world_size == 1:
        return World(0, 1, 0, device, None)
    # The flight recorder keeps the last collectives of every group (a ring buffer, read only
    # when the hang watchdog fires: resilience/watchdog.py); it must be on before the group exists.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if use_cuda else None,
        )
        _OWN_GROUP = True
        if _KEEP:  # the next call of the program's joins it again: torchrun's store takes one init per process
            atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return World(rank, world_size, local_rank, device, backend)


# How long a rank that learnt of rank 0's crash waits for the launcher to stop it.
PEER_CRASH_GRACE_S = 30.0


def rank0_first(world: World, fn: Callable[[], T], what: str, timeout_s: float, hint: str) -> T | None:
    """Run `fn` on rank 0 only (preparing data, say) while the other ranks wait for it.

    They wait on the process group's key-value store, not in a collective, so a long job
    on rank 0 never trips the collective timeout, and their own limit is `timeout_s`. Rank
    0's outcome travels through the store: a UserError reaches every rank as the same line,
    any other failure as a line naming it, so no rank is left waiting in a collective.
    """
    if not world.distributed:
        return fn()
    # The store torch's env:// rendezvous made; private in torch, and the one every rank shares.
    store = dist.distributed_c10d._get_default_store()
    key = f"scaletrain/rank0/{what}"
    if world.is_main:
        try:
            result = fn()
        except UserError as e:
            _tell_and_wait_for_readers(store, key, f"user\n{e}", world.world_size - 1)
            raise
        except BaseException as e:
            _tell_and_wait_for_readers(store, key, f"crash\n{type(e).__name__}: {e}", world.world_size - 1)
            raise
        store.set(key, "ok\n")
        return result
    # Polled rather than store.wait: that one's timeout also prints c10d socket warnings.
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise UserError(f"rank 0 did not finish {what} within {timeout_s:g} s; {hint}")
        time.sleep(0.1)
    status, _, message = store.get(key).decode().partition("\n")
    store.add(f"{key}/read", 1)
    if status == "user":
        raise UserError(message)
    if status == "crash":
        line = f"rank 0 failed while {what} ({message}); its traceback is in rank 0's output"
        # Rank 0 is on its way out with its own exit code, but printing its traceback and
        # tearing down can take it longer than this rank takes to exit 2; the agent reports
        # whichever it sees first and stops the rest with SIGTERM, and a crash reported as
        # bad input was seen in CI. So this rank says its line now and waits to be stopped.
        from scaletrain.launch.torchrun import report_error

        report_error(line, world.rank)
        time.sleep(PEER_CRASH_GRACE_S)
        raise UserError(line)
    return None


# How long rank 0 waits for the other ranks to read why it failed before it goes on to exit.
READ_GRACE_S = 10.0


def _tell_and_wait_for_readers(store: dist.Store, key: str, value: str, readers: int) -> None:
    """Rank 0's failure, set for the waiting ranks; then a wait (up to READ_GRACE_S) until
    each has read it: the store's server may live in rank 0's process (torchrun with a
    store per attempt), and a rank 0 that exits between two polls of a peer left that peer
    a closed connection instead of the reason (seen once the start-up got faster)."""
    store.set(key, value)
    deadline = time.monotonic() + READ_GRACE_S
    while store.add(f"{key}/read", 0) < readers and time.monotonic() < deadline:
        time.sleep(0.02)


def ensure_process_group(world: World) -> None:
    """A process group even for one rank, for the engines that need one (FSDP2, DeepSpeed).

    Multi-rank runs already have theirs (init_distributed). A single process gets a group of
    one on a private in-memory store: no port, no launcher environment (DeepSpeed still
    reads the variables below). shutdown() destroys it; so does interpreter exit.
    """
    global _OWN_GROUP
    if dist.is_initialized():
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    backend = "nccl" if world.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _OWN_GROUP = True
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())


_OWN_GROUP = False  # this process made the default group (from the launcher's environment, or its own of one)
_KEEP = False  # ...and keeps it until it exits (keep_process_group)


def keep_process_group() -> None:
    """A program that calls scaletrain (api.py) may train, then evaluate, in one process: the
    group made from the launcher's environment stays for the next call (torchrun's store
    serves one init per process) and goes at the interpreter's exit. The CLI's process ends
    after its one command and destroys its group itself (shutdown)."""
    global _KEEP
    _KEEP = True


def all_hostnames(world: World) -> list[str]:
    """Every rank's host name, by rank (one collective, at start-up)."""
    return gather_objects(world, socket.gethostname())


def gather_objects(world: World, obj: T) -> list[T]:
    """Collective: every rank's `obj` (picklable), by rank, on every rank."""
    if not world.distributed:
        return [obj]
    out: list[T] = [obj] * world.world_size
    dist.all_gather_object(out, obj, group=world.group)
    return out


def broadcast_object(world: World, obj: T) -> T:
    """Collective: rank 0's `obj` (picklable) on every rank."""
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=world.group)
    return box[0]


def versions() -> dict[str, str | None]:
    """The versions that decide numerics and formats (without importing DeepSpeed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("scaletrain", "deepspeed"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier(group=world.group)


_SIDE_GROUPS: dict[str, Any] = {}


def side_group(name: str) -> Any:
    """Collective on its first call per `name`: a gloo group of every rank for work that runs
    beside training (a checkpoint written by a background thread). Collectives of two
    threads on one group interleave and deadlock (seen with gloo), so each gets its own;
    gloo also keeps that work on the CPU while training uses NCCL. None without a process
    group."""
    if not dist.is_initialized():
        return None
    if name not in _SIDE_GROUPS:
        _SIDE_GROUPS[name] = dist.new_group(backend="gloo")
    return _SIDE_GROUPS[name]


def shutdown(world: World) -> None:
    """Destroy the process group this process made (from the launcher's environment, or a
    single rank's own), unless the program keeps it (keep_process_group); a group the
    caller made stays. Free the engines first: a DDP model alive at this point
    intermittently aborts gloo."""
    global _OWN_GROUP
    if _OWN_GROUP and not _KEEP and dist.is_initialized():
        _SIDE_GROUPS.clear()  # they go with the process group; else they stay with it, for the next call
        dist.destroy_process_group()
        _OWN_GROUP = False
