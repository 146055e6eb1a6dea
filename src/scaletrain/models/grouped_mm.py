"""The experts of a mixture of experts as grouped matrix multiplies (torch._grouped_mm): one
kernel per projection over every expert's rows, the group boundaries a cumulative sum of
the token counts on the device, so nothing is read back to the host (models/moe.py).

Where torch runs it without a host sync. CUDA: its CUTLASS kernel takes bf16 on compute
capability 9.x and 10.x (`_grouped_mm_cuda` in aten/src/ATen/native/cuda/GroupedBlas.cpp);
any other dtype or GPU takes its fallback, which copies the offsets to the host and loops
(torch 2.11's CUDA build, the GPU machines', has the same fallback). CPU: torch 2.13 and
2.11 have it for fp32, bf16 and fp16 (the host holds the offsets anyway); each dtype is
asked once per process, by a tiny call (`_without_sync`).

Under torch.compile the op's fake implementation (torch/_meta_registrations.py) accepts
bf16 only, so a compiled block in another dtype calls it through `scaletrain::grouped_mm`,
a custom op whose fake implementation takes any dtype, whose kernel is torch's, and
whose backward is torch's own formula (the input gradient a grouped product with the
transposed weights, the weight gradient one per group over its rows).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

# The planner's clock traces the path a GPU (and this CPU) runs under auto: the grouped one
# (planning/clock/trace.py); its memory trace keeps the loop (module docstring of moe.py).
_GROUPED_ON_FAKE = contextvars.ContextVar("grouped_on_fake", default=False)


@contextlib.contextmanager
def grouped_on_fake_tensors() -> Iterator[None]:
    """Inside: experts_impl=auto runs grouped on fake tensors too (what the clock prices)."""
    token = _GROUPED_ON_FAKE.set(True)
    try:
        yield
    finally:
        _GROUPED_ON_FAKE.reset(token)


def uses_grouped_mm(impl: str, tokens: Tensor, weight: Tensor) -> bool:
    """Whether the experts run as grouped matrix multiplies: model.moe.experts_impl, and
    for auto where torch runs them without a host sync, or in a compiled block (whose graph
    the loop's .tolist() would break); on the planner's fake tensors only where its clock
    asks (grouped_on_fake_tensors)."""
    if impl != "auto":
        return impl == "grouped"
    if not hasattr(torch, "_grouped_mm"):
        return False
    if isinstance(tokens, torch._subclasses.FakeTensor) or tokens.is_meta:
        return _GROUPED_ON_FAKE.get() and aligned(weight.shape[-2], weight.shape[-1], compute_dtype(tokens))
    dtype = compute_dtype(tokens)
    if not aligned(weight.shape[-2], weight.shape[-1], dtype):
        return False
    if torch.compiler.is_compiling():
        return True
    return _without_sync(tokens.device, dtype)


def aligned(dim: int, hidden: int, dtype: torch.dtype) -> bool:
    """The kernel reads rows whose byte strides are multiples of 16."""
    unit = 16 // dtype.itemsize
    return dim % unit == 0 and hidden % unit == 0


def compute_dtype(tokens: Tensor) -> torch.dtype:
    device = tokens.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tokens.dtype


def grouped_swiglu(tokens: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, counts: Tensor) -> Tensor:
    """SwiGLU of expert i on rows [sum(counts[:i]), sum(counts[:i+1])) of `tokens`; rows
    past sum(counts) come out unwritten (garbage), as does their input gradient."""
    offsets = group_offsets(counts)
    gate = grouped_linear(tokens, w1, offsets)
    up = grouped_linear(tokens, w3, offsets)
    return grouped_linear(F.silu(gate) * up, w2, offsets)


def grouped_linear(tokens: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """Rows [offsets[i-1], offsets[i]) of `tokens` times weight[i] ([groups, in, out]: a
    transposed view of transformers' stacked [groups, out, in] serves, as its own kernels
    pass it), in the dtype the loop's matmuls would compute in (autocast's)."""
    # torch._grouped_mm is on no autocast list: cast as autocast casts the loop's matmuls,
    # so that both paths compute in the same dtype.
    dtype = compute_dtype(tokens)
    return _mm(tokens.to(dtype), weight.to(dtype), offsets)


def group_offsets(counts: Tensor) -> Tensor:
    """The grouped kernel's group ends: a cumulative sum on the device, nothing read back."""
    return torch.cumsum(counts, 0, dtype=torch.int32)


def _mm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    # Fake tensors outside compile too: the planner traces a block with experts_impl=grouped.
    if a.dtype != torch.bfloat16 and (torch.compiler.is_compiling() or isinstance(a, torch._subclasses.FakeTensor)):
        return grouped_mm(a, b, offsets)
    return torch._grouped_mm(a, b, offs=offsets)


@torch.library.custom_op("scaletrain::grouped_mm", mutates_args=())
def grouped_mm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """torch._grouped_mm(a, b, offs=offsets) for a [rows, k] and b [groups, k, n] (the
    forward) or a [k, rows] and b [rows, n] (the weight gradient, [groups, k, n])."""
    return torch._grouped_mm(a, b, offs=offsets)


@grouped_mm.register_fake
def _(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[-1])


def _keep(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    a, b, offsets = ctx.saved_tensors  # type: ignore[attr-defined]
    grad = grad.contiguous()  # the kernel reads rows or columns, never a broadcast's zero strides
    return grouped_mm(grad, b.transpose(-2, -1), offsets), grouped_mm(a.t(), grad, offsets), None


grouped_mm.register_autograd(_backward, setup_context=_keep)


@functools.cache
def _without_sync(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
    if device.type != "cpu":
        return False
    try:
        # No autograd: inside an activation-checkpointed forward, tensors saved for a
        # backward here would be counted as the block's, and its recompute (the probe
        # cached by then) would save fewer. The backward's own form is called directly.
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            a, b, offsets = (
                torch.ones(4, 8, dtype=dtype),
                torch.ones(2, 8, 8, dtype=dtype),
                torch.tensor([1, 4], dtype=torch.int32),
            )
            torch._grouped_mm(a, b, offs=offsets)  # the forward: rows x stacked weights
            torch._grouped_mm(a.t(), a, offs=offsets)  # the weights' gradient: one product per group of rows
    except (RuntimeError, NotImplementedError):
        return False
    # Whether it runs is the question (its numbers: tests/test_moe.py); nothing is read
    # back, so a host-sync count around a first forward sees nothing of this probe.
    return True
