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
released once the copy is done (record_stream). The backward asks for the tensors in
about the reverse order of the forward's saves (the last block's first): when it asks for
one, the one saved before it starts back to the device on a second side stream (a
prefetch one tensor deep: under checkpointing, the previous block's input arrives while
this block recomputes and runs backward), and a tensor not prefetched comes back on
demand. So at most one tensor more than the backward needs is on the device.

On a CPU the host is where the tensors are already: nothing moves (a copy would only add
memory), the hook counts what it would move; `copy=True` makes it copy into fresh tensors
there too, and back (the prefetch included), which the unit tests use to check the round
trip.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MIN_ELEMENTS = 1 << 14  # 64 KiB of fp32


@dataclass
class _Held:
    """One saved tensor on the host, its place among its forward's, and its way back."""

    device: torch.device
    host: torch.Tensor
    copied: torch.cuda.Event | None  # the copy to the host done (CUDA)
    # Every tensor its forward held, in saving order, by weak reference: autograd's graph
    # owns each (its host memory goes when its node does), and a list of them would be a cycle.
    order: list[weakref.ref[_Held]]
    index: int
    back: torch.Tensor | None = None  # prefetched to the device, not yet given to the backward
    arrived: torch.cuda.Event | None = None


class ActivationOffload:
    def __init__(self, device: torch.device, copy: bool = False):
        self.device = device
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None  # copies to the host
        self.back_stream = torch.cuda.Stream(device) if cuda else None  # prefetches to the device
        self.copy = copy
        self.tensors = 0  # moved to the host since the counters were last read (moved())
        self.bytes = 0
        self.prefetched = 0  # tensors the backward found already back (prefetch hits)
        self._order: list[weakref.ref[_Held]] = []

    def __call__(self) -> AbstractContextManager[Any]:
        """The context a forward runs in (each forward's tensors their own sequence)."""
        self._order = []
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
            if not self.copy:
                return tensor  # a CPU run: nothing moves
            host, copied = tensor.clone(), None
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.stream)
            tensor.record_stream(self.stream)  # its memory is reused only after the copy
        held = _Held(tensor.device, host, copied, self._order, len(self._order))
        self._order.append(weakref.ref(held))
        return held

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        held: _Held = packed
        before = held.order[held.index - 1]() if held.index > 0 else None
        if before is not None:
            self._bring(before)  # the one the backward asks for next
        if held.back is not None:
            self.prefetched += 1
            tensor, arrived, held.back, held.arrived = held.back, held.arrived, None, None
            if arrived is not None:
                current = torch.cuda.current_stream(held.device)
                current.wait_event(arrived)
                tensor.record_stream(current)  # made on the prefetch stream, used on this one
            return tensor
        if held.copied is None:
            return held.host.clone()  # copy=True on a CPU: a fresh tensor back, as from a GPU's host
        torch.cuda.current_stream(held.device).wait_event(held.copied)
        return held.host.to(held.device, non_blocking=True)

    def _bring(self, held: _Held) -> None:
        """Start `held` back to the device (once) on the prefetch stream."""
        if held.back is not None:
            return
        if self.back_stream is None:
            held.back = held.host.clone()
            return
        with torch.cuda.stream(self.back_stream):
            assert held.copied is not None
            self.back_stream.wait_event(held.copied)
            held.back = held.host.to(held.device, non_blocking=True)
            held.arrived = torch.cuda.Event()
            held.arrived.record(self.back_stream)
