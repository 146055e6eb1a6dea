"""Which of SDPA's kernels a run's attention uses (train.attention_kernel).

torch picks SDPA's backend from a fixed priority (FlashAttention 2, memory-efficient, math,
cuDNN): cuDNN's fused attention, which is faster than FlashAttention 2 at the short lengths
of most pretraining on Hopper (pytorch/pytorch#138907; transformers#48163 weighed making it
the default there), is never chosen while FlashAttention applies. Which wins depends on the
GPU, the head size and the length, so `auto` measures both at the run's own call (its
micro-batch's query, key and value as the model lays them out, grouped-query heads included,
in its compute dtype, forward and backward, a few tenths of a second: the first version timed
contiguous tensors of the query's size, took cuDNN at 1.38x on a lent H200, and the compiled
1b step ran no faster than with FlashAttention pinned) and puts the faster first in the
priority for the whole run: the blocks,
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
from dataclasses import dataclass
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
        return best, "FlashAttention could not run this call"
    best = min(ran, key=ran.__getitem__)
    if best != "flash" and ran[best] < (1 - MARGIN) * ran["flash"]:
        return best, f"{ran['flash'] / ran[best]:.2f}x FlashAttention's speed at this call (measured)"
    times = ", ".join(f"{k} {s * 1e3:.2f} ms" for k, s in sorted(ran.items()))
    refused = "".join(f"; {k} cannot run this call" for k, s in sorted(seconds.items()) if not s)
    return "flash", f"torch's choice; measured {times}{refused}"


Layout = tuple[tuple[int, ...], tuple[int, ...]]  # a tensor's shape and strides


@dataclass(frozen=True)
class AttentionCall:
    """The run's attention call as the model makes it: query, key and value's shapes and strides.
    Both matter to which kernel can take it and how fast: a model hands SDPA its heads as a
    transposed view of [batch, sequence, heads, head size], and under grouped-query attention
    fewer key and value heads than query heads (enable_gqa), which a kernel may refuse, so that
    torch falls to the next in the priority. A contiguous tensor of the same size measures
    another call."""

    q: Layout
    k: Layout
    v: Layout

    @classmethod
    def contiguous(cls, shape: tuple[int, ...], kv_heads: int | None = None) -> AttentionCall:
        """[batch, heads, sequence, head size] tensors laid out as the models make them."""
        b, h, t, d = shape

        def layout(heads: int) -> Layout:
            return (b, heads, t, d), (t * heads * d, d, heads * d, 1)

        return cls(layout(h), layout(kv_heads or h), layout(kv_heads or h))

    @property
    def gqa(self) -> bool:
        return self.q[0][-3] != self.k[0][-3]

    def tensors(self, dtype: torch.dtype, device: torch.device, generator: torch.Generator | None = None) -> list[torch.Tensor]:
        out = []
        for shape, stride in (self.q, self.k, self.v):
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            out.append(t.normal_(generator=generator))
        return out

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)


def time_kernel(kernel: str, call: AttentionCall, dtype: torch.dtype, device: torch.device) -> float | None:
    """Seconds of one causal forward and backward of `call` with only `kernel` allowed; None
    where it cannot run it."""
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    q, k, v = (t.requires_grad_(True) for t in call.tensors(dtype, device))

    def once() -> None:
        with sdpa_kernel([KERNELS[kernel]]):
            call.sdpa(q, k, v).sum().backward()

    try:
        once()
        sync()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            once()
            sync()
            times.append(time.perf_counter() - t0)
    except RuntimeError:  # "No available kernel" for this call or device
        return None
    return sorted(times)[len(times) // 2]


def same_result(kernel: str, reference: str, call: AttentionCall, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `kernel`'s causal output and input gradients at `call` are `reference`'s, to a
    tolerance of a few roundings of `dtype`: both accumulate in fp32 and round their results
    once, in different orders, so they differ by about one ulp of the result's size; a kernel
    that computes something else (another mask, a dropped term) differs by the values' own size."""
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = call.tensors(dtype, device, generator)

    def run(name: str) -> list[torch.Tensor]:
        q, k, v = (t.detach().clone().requires_grad_(True) for t in inputs)  # clone keeps the strides
        with sdpa_kernel([KERNELS[name]]):
            out = call.sdpa(q, k, v)
        out.backward(torch.ones_like(out))
        return [out.detach().float(), *(t.grad.float() for t in (q, k, v))]  # type: ignore[union-attr]

    # 4 ulps of the largest value (bf16: 2^-6 of it; fp16 2^-9; fp32 2^-21).
    ulps = 4 * torch.finfo(dtype).eps
    return all((a - b).abs().max() <= ulps * b.abs().max() for a, b in zip(run(kernel), run(reference), strict=True))


def choose(call: AttentionCall, dtype: torch.dtype, device: torch.device) -> tuple[str, str]:
    """(kernel, why) of train.attention_kernel=auto on a GPU at the run's attention `call`: the
    faster, only where it also computes what FlashAttention does."""
    kernel, why = faster({k: time_kernel(k, call, dtype, device) for k in ("flash", "cudnn")})
    if kernel != "flash" and not same_result(kernel, "flash", call, dtype, device):
        return "flash", f"{kernel}'s was faster but its result differed from FlashAttention's at this call"
    return kernel, why


def traced_call(spec: Any, micro_batch: int, seq_len: int, strategy: str, precision: str) -> AttentionCall | None:
    """The model's attention call (query, key and value as laid out) as the planner's trace of
    one block finds it (planning/clock/trace.py: any model it can trace), or None."""
    from scaletrain.planning.activations import BLOCK_TRACE
    from scaletrain.planning.clock.compute import low_dtype
    from scaletrain.planning.clock.trace import block_work, tensor_layouts
    from scaletrain.planning.memory import regime

    try:
        work = block_work(spec, micro_batch, min(seq_len, BLOCK_TRACE), regime(strategy, precision), low_dtype(precision))
    except Exception:  # a model the trace cannot run (its own code): torch's order, said by the caller
        return None
    calls = work.forward.of("attention")
    if not calls:
        return None
    # Query, key and value are the kernel's first three arguments.
    q, k, v = (tuple(tuple(x) for x in layout) for layout in tensor_layouts(calls[0].args)[:3])  # type: ignore[union-attr]
    return AttentionCall(q, k, v)  # type: ignore[arg-type]


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
        call = traced_call(spec, cfg.train.micro_batch, cfg.data.seq_len // cp, cfg.parallel.strategy, cfg.precision)
        if call is None:
            say("attention: torch's SDPA order (the model's attention call was not traced, so nothing was measured)")
            yield ""
            return
        kernel, why = broadcast_object(world, choose(call, DTYPES[cfg.precision], world.device) if world.is_main else ("", ""))
    else:
        kernel, why = choice, "train.attention_kernel"
    say(f"attention: SDPA's {kernel} kernel first ({why})")
    with sdpa_kernel(order(kernel), set_priority=True):
        yield kernel
