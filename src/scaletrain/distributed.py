"""Process-group set-up from the launcher's environment, and the few rank helpers we need.

torchrun (and the deepspeed launcher) export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; a plain `scaletrain train` has none of them and runs as a world of one with
no process group at all, so single-process runs pay nothing for distribution.
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, TypeVar

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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def launcher_rank() -> int:
    """Rank from the environment, usable before any process group exists (error printing)."""
    return int(os.environ.get("RANK", "0"))


def init_distributed(device_choice: str = "auto", backend_choice: str = "auto", timeout_s: float = 600) -> World:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    if device_choice == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device=cuda but no CUDA device is visible; accepted here: auto or cpu")
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    if world_size == 1:
        return World(0, 1, 0, device, None)

    backend = backend_choice if backend_choice != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise UserError("parallel.backend=nccl needs CUDA devices; on CPU use parallel.backend=gloo (or auto)")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if use_cuda else None,
        )
    return World(rank, world_size, local_rank, device, backend)


def on_main_then_all(world: World, fn: Callable[[], T]) -> T | None:
    """Run `fn` on rank 0 only (e.g. preparing data) while the others wait.

    A UserError on rank 0 is re-raised on every rank with the same message, so a bad input
    stops the whole job cleanly instead of leaving the other ranks hanging at a barrier.
    """
    result, message = None, None
    if world.is_main:
        try:
            result = fn()
        except UserError as e:
            message = str(e)
    if world.distributed:
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message is not None:
        raise UserError(message)
    return result


def all_hostnames(world: World) -> list[str]:
    """Every rank's host name, by rank (one collective, at start-up)."""
    me = socket.gethostname()
    if not world.distributed:
        return [me]
    names: list[str] = [""] * world.world_size
    dist.all_gather_object(names, me)
    return names


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
        dist.barrier()


def shutdown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
