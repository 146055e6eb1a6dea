"""DDP gradient compression (parallel.grad_compression) through torch's communication hooks.

fp16 / bf16: each bucket is cast, all-reduced and cast back (half the bytes). powersgd:
torch's PowerSGD hook (Vogels et al. 2019) sends rank-r factors P and Q instead of each
gradient matrix, keeping the compression error of every bucket on each rank (error
feedback) and warm-starting Q from the last step. That state is part of training: it is
saved beside the checkpoint's state, one file per rank, and restored on resume at the
same world size, so a resumed run continues exactly. At another world size (or through a
conversion) it starts afresh, warm-up of plain all-reduce included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from scaletrain.errors import UserError


def register(ddp: Any, par: Any, backend: str) -> powerSGD_hook.PowerSGDState | None:
    """Register the configured hook on the DDP module; the PowerSGD state, if any."""
    kind = par.grad_compression
    if kind == "none":
        return None
    if kind == "bf16" and backend != "nccl":
        raise UserError(f"parallel.grad_compression=bf16 needs NCCL, this run uses {backend}; accepted: fp16 or powersgd")
    if kind in ("fp16", "bf16"):
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook if kind == "fp16" else default_hooks.bf16_compress_hook)
        return None
    # The same random_seed on every rank: the first P (before warm start) must agree.
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=par.powersgd_rank,
        start_powerSGD_iter=par.powersgd_start_step,
        random_seed=0,
    )
    hook = powerSGD_hook.powerSGD_hook
    ddp.register_comm_hook(state, hook if backend == "nccl" else _one_bucket_at_a_time(hook))
    return state


def _one_bucket_at_a_time(hook: Any) -> Any:
    """The hook, finishing each bucket before DDP hands it the next.

    PowerSGD chains two all-reduces per bucket through future callbacks, and a callback
    issues the second one from gloo's own thread while the next bucket's hook issues its
    first from autograd's: the order differs between ranks and gloo fails ("Received data
    size doesn't match expected size", seen at world 2). Waiting here keeps one order on
    every rank, at the cost of overlap with backward; NCCL orders its work on a stream and
    runs the hook as torch ships it (torch tests PowerSGD on NCCL only)."""

    # No annotations: DDP checks them against dist.GradBucket and Future as objects, and
    # this module's are strings (PEP 563).
    def in_order(state, bucket):
        future = hook(state, bucket)
        future.wait()
        return future

    return in_order


def _file(path: Path, rank: int) -> Path:
    return path / f"powersgd_rank{rank}.pt"


def save(state: powerSGD_hook.PowerSGDState, path: Path, rank: int, world_size: int) -> None:
    """Write this rank's PowerSGD state now (it changes every step; a background checkpoint
    must hold this step's). The process group is the run's, never saved."""
    slots = {slot: getattr(state, slot) for slot in state.__slots__ if slot != "process_group"}
    path.mkdir(parents=True, exist_ok=True)
    torch.save({"world_size": world_size, "slots": slots}, _file(path, rank))


def load(state: powerSGD_hook.PowerSGDState, path: Path, rank: int, world_size: int) -> bool:
    """Restore this rank's state if the checkpoint has it for this world size."""
    f = _file(path, rank)
    if not f.is_file():
        return False
    # Our own checkpoint's file: the state holds numpy's RandomState, which weights_only refuses.
    saved = torch.load(f, weights_only=False)
    if saved["world_size"] != world_size:
        return False
    for slot, value in saved["slots"].items():
        setattr(state, slot, value)
    return True
