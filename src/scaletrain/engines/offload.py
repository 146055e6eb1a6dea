"""train.activation_offload: what autograd saves for backward during a forward, held in
host memory until the backward needs it (the engines that accumulate: ddp, fsdp, zero1-3).

torch's saved-tensors hooks see every tensor a forward saves. Parameters stay where they
are (they are not activations, and every engine holds them anyway); so do tensors under
MIN_ELEMENTS (norms' statistics, indices: not worth a copy). Under activation
checkpointing a block saves only its input (the checkpoint's recompute runs inside hooks
of its own, nested inside these), so what goes to the host is exactly the checkpointed
block inputs, the residual stream, plus what the head and the loss save: Arctic
long-sequence training's checkpoint offload.

On CUDA each copy to pinned host memory runs on a side stream after the forward's work
that made the tensor (it overlaps the rest of the forward), and the device memory is
released once the copy is done (record_stream); the backward brings each tensor back on
demand (a pinned, non-blocking copy on the compute stream). Not prefetched: docs/gpu.md
has the check that measures what that costs. On a CPU the host is where the tensors are
already: nothing moves (a copy would only add memory), the hook counts what it would
move; `copy=True` makes it copy into fresh tensors there too, which the unit tests use to
check the round trip.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

MIN_ELEMENTS = 1 << 14  # 64 KiB of fp32


class ActivationOffload:
    def __init__(self, device: torch.device, copy: bool = False):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copy = copy
        self.tensors = 0  # moved to the host since the counters were last read (moved())
        self.bytes = 0

    def __call__(self) -> AbstractContextManager[Any]:
        """The context a forward runs in."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def moved(self) -> tuple[int, int]:
        """(tensors, bytes) moved to the host since the last call."""
        out = (self.tensors, self.bytes)
        self.tensors = self.bytes = 0
        return out

    def _pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter) or tensor.numel() < MIN_ELEMENTS:
            return tensor
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()
        if self.stream is None:
            return tensor.device, tensor.clone() if self.copy else tensor, None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        tensor.record_stream(self.stream)  # its memory is reused only after the copy
        return tensor.device, host, done

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, done = packed
        if done is None:
            return host
        torch.cuda.current_stream(device).wait_event(done)
        return host.to(device, non_blocking=True)
