"""Which of SDPA's kernels a run's attention uses (train.attention_kernel).

torch picks SDPA's backend from a fixed priority (FlashAttention 2, memory-efficient, math,
cuDNN): cuDNN's fused attention, which is faster than FlashAttention 2 at the short lengths
of most pretraining on Hopper (pytorch/pytorch#138907; transformers#48163 weighed making it
the default there), is never chosen while FlashAttention applies. Which wins depends on the
GPU, the head size and the length, so `auto` measures both at the run's own shape (its
micro-batch's heads, sequence and head size in its compute dtype, forward and backward, a few
tenths of a second) and puts the faster first in the priority for the whole run: the blocks,
compiled or not (inductor takes the backend chosen when it traces), a Hugging Face model's
SDPA calls and evaluation. A kernel that cannot take a call (a mask, a head size) falls to
the next in torch's order. Rank 0's choice is every rank's: replicas must run the same kernel
(their weights are compared: guards.weight_hash_every).

On a CPU there is nothing to choose: torch's CPU SDPA takes no priority (its flash kernel where
it applies, else math), so torch's choice stays, and a named kernel says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from scaletrain.launch.distributed import World, broadcast_object
from scaletrain.planning.clock.rates import KERNEL_MARGIN

KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# torch's own order (sdp_utils' default priority): what follows the chosen kernel.
TORCH_ORDER = ("flash", "efficient", "math", "cudnn")
# The measured winner must be this much faster to replace torch's choice: within the timing's
# spread (a few percent over a handful of repeats) torch's own order stays. One figure with the
# clock's, which prices the kernel this takes.
MARGIN = KERNEL_MARGIN


def order(first: str) -> list[SDPBackend]:
    """SDPA's priority with `first` ahead of torch's own order."""
    return [KERNELS[first], *(KERNELS[k] for k in TORCH_ORDER if k != first)]


def faster(seconds: dict[str, float | None]) -> tuple[str, str]:
    """(kernel, why) from each candidate's measured seconds (None: it could not run the call):
    the fastest where it beats FlashAttention by MARGIN, else FlashAttention."""
    ran = {k: s for k, s in seconds.items() if s}
    if "flash" not in ran:
        best = min(ran, key=ran.__getitem__) if ran else "flash"
        return best, "FlashAttention could not run this shape"
    best = min(ran, key=ran.__getitem__)
    if best != "flash" and ran[best] < (1 - MARGIN) * ran["flash"]:
        return best, f"{ran['flash'] / ran[best]:.2f}x FlashAttention's speed at this shape (measured)"
    times = ", ".join(f"{k} {s * 1e3:.2f} ms" for k, s in sorted(ran.items()))
    return "flash", f"torch's choice; measured {times}"


def time_kernel(kernel: str, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> float | None:
    """Seconds of one causal forward and backward of SDPA at `shape` (batch, heads, seq, head
    size) with only `kernel` allowed; None where it cannot run it."""
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    q, k, v = (torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def once() -> None:
        with sdpa_kernel([KERNELS[kernel]]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    try:
        once()
        sync()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            once()
            sync()
            times.append(time.perf_counter() - t0)
    except RuntimeError:  # "No available kernel" for this shape or device
        return None
    return sorted(times)[len(times) // 2]


def same_result(kernel: str, reference: str, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `kernel`'s causal output and input gradients at `shape` are `reference`'s, to a
    tolerance of a few roundings of `dtype`: both accumulate in fp32 and round their results
    once, in different orders, so they differ by about one ulp of the result's size; a kernel
    that computes something else (another mask, a dropped term) differs by the values' own size."""
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = [torch.randn(*shape, device=device, dtype=dtype, generator=generator) for _ in range(3)]

    def run(name: str) -> list[torch.Tensor]:
        q, k, v = (t.clone().requires_grad_(True) for t in inputs)
        with sdpa_kernel([KERNELS[name]]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
        return [out.detach().float(), *(t.grad.float() for t in (q, k, v))]  # type: ignore[union-attr]

    # 4 ulps of the largest value (bf16: 2^-6 of it; fp16 2^-9; fp32 2^-21).
    ulps = 4 * torch.finfo(dtype).eps
    return all((a - b).abs().max() <= ulps * b.abs().max() for a, b in zip(run(kernel), run(reference), strict=True))


def choose(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> tuple[str, str]:
    """(kernel, why) of train.attention_kernel=auto on a GPU at the run's attention `shape`: the
    faster, only where it also computes what FlashAttention does."""
    kernel, why = faster({k: time_kernel(k, shape, dtype, device) for k in ("flash", "cudnn")})
    if kernel != "flash" and not same_result(kernel, "flash", shape, dtype, device):
        return "flash", f"{kernel}'s was faster but its result differed from FlashAttention's at this shape"
    return kernel, why


def traced_shape(spec: Any, micro_batch: int, seq_len: int, strategy: str, precision: str) -> tuple[int, int, int, int] | None:
    """(1, batch x heads, sequence, head size) of the model's attention as the planner's trace of
    one block finds it (planning/clock/trace.py: any model it can trace), or None."""
    from scaletrain.planning.activations import BLOCK_TRACE
    from scaletrain.planning.clock.compute import low_dtype
    from scaletrain.planning.clock.trace import block_work
    from scaletrain.planning.memory import regime

    try:
        work = block_work(spec, micro_batch, min(seq_len, BLOCK_TRACE), regime(strategy, precision), low_dtype(precision))
    except Exception:  # a model the trace cannot run (its own code): torch's order, said by the caller
        return None
    calls = work.forward.of("attention")
    return (1, calls[0].shape[0], calls[0].shape[1], calls[0].shape[3]) if calls else None


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextmanager
def attention_kernel(cfg: Any, spec: Any, cp: int, world: World, say: Any) -> Iterator[str]:
    """The run's SDPA priority (train.attention_kernel), rank 0's measured choice on every rank,
    said in one line; torch's own order where there is nothing to choose."""
    choice = cfg.train.attention_kernel
    if world.device.type != "cuda":
        if choice != "auto":  # torch's CPU SDPA takes no priority: its flash kernel where it applies, else math
            say(f"attention: train.attention_kernel={choice} orders a GPU's kernels; this CPU's SDPA chooses its own")
        yield ""
        return
    if choice == "auto":
        shape = traced_shape(spec, cfg.train.micro_batch, cfg.data.seq_len // cp, cfg.parallel.strategy, cfg.precision)
        if shape is None:
            say("attention: torch's SDPA order (the model's attention shape was not traced, so nothing was measured)")
            yield ""
            return
        kernel, why = broadcast_object(world, choose(shape, DTYPES[cfg.precision], world.device) if world.is_main else ("", ""))
    else:
        kernel, why = choice, "train.attention_kernel"
    say(f"attention: SDPA's {kernel} kernel first ({why})")
    with sdpa_kernel(order(kernel), set_priority=True):
        yield kernel
