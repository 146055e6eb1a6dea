"""Activation memory derived from the real model code, not from a hand formula.

One block of the model, and its head (final norm, output projection, loss), both from the
model's spec, run forward on
fake tensors (FakeTensorMode: shapes, dtypes and kernel choice as on a real CPU, no
memory). A saved-tensors hook records every tensor autograd keeps for backward; views of
the same tensor count once. The numbers therefore follow whatever the block does: SwiGLU
width, grouped-query heads, fp32 norms, the SDPA kernel (flash keeps only a log-sum-exp,
not the T x T scores), autocast's low-precision copies of inputs and weights.

Checked against real CPU tensors: identical byte counts (tests/test_plan.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from scaletrain.models.capabilities import Traceable, capability
from scaletrain.models.spec import ModelSpec
from scaletrain.planning.trace_cache import cached

# How the engine runs the forward, which decides what dtype everything is saved in:
#   fp32      everything fp32
#   autocast  fp32 weights and residual stream, matmuls in bf16/fp16 (torch engines' bf16/fp16)
#   pure16    weights and activations in 16 bits (FSDP2 MixedPrecisionPolicy, DeepSpeed bf16/fp16)
REGIMES = ("fp32", "autocast", "pure16")


@dataclass(frozen=True)
class BlockActivations:
    saved: int  # bytes autograd keeps per block until its backward
    weight_copies: int  # of which: low-precision weight casts (autocast), proportional to params
    block_input: int  # the residual-stream input: all a checkpointed block keeps


@dataclass(frozen=True)
class HeadActivations:
    saved: int  # final norm + output projection + loss, kept for backward
    logits: int  # one copy of the logits in their own dtype (B*T*V)
    logits_fp32: int  # the fp32 logits the loss works on (also the size of their gradient)


def _trace_saved(fn, regime: str) -> tuple[int, int]:
    """Total and weight-copy bytes saved for backward while `fn` runs on fake tensors."""
    seen: dict[int, tuple[int, bool]] = {}
    keep = []  # hold references so ids are not reused during the trace

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if base.requires_grad and base.is_leaf:
            return t  # a parameter (or a view of one, e.g. a transposed weight): model state
        keep.append(base)
        seen[id(base)] = (base.numel() * base.element_size(), base.dim() == 2 and _is_weight_cast(base))
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if regime == "autocast" else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        fn()
    total = sum(n for n, _ in seen.values())
    weights = sum(n for n, w in seen.values() if w)
    return total, weights


_WEIGHT_SHAPES: set[tuple[int, ...]] = set()


def _is_weight_cast(t: torch.Tensor) -> bool:
    return tuple(t.shape) in _WEIGHT_SHAPES and t.dtype != torch.float32


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Constructing in the target dtype: converting fake parameters afterwards (.to) trips
    # over weak references that other tooling (MemTracker) may hold on parameters.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def regime_dtypes(regime: str, low: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(parameter dtype, residual-stream dtype) for a regime."""
    return (low, low) if regime == "pure16" else (torch.float32, torch.float32)


# Every tensor autograd saves either has the micro-batch as its leading dimension or does
# not depend on it at all (autocast's weight casts), so the bytes saved are exactly
# fixed + micro_batch x per_sample. Two traces (1 and 2 samples) give both parts, and any
# micro-batch then costs no tracing: the planner's search for the largest micro-batch
# that fits used to trace ~26 times, seconds at the start of every run
# (tests/test_plan.py checks the extrapolation against direct traces).


# Past this many positions a block is traced at a quarter, half and all of it and its saved
# bytes extended along that line: with a flash kernel (a log-sum-exp per row, not the T x T scores)
# every saved tensor is a fixed size or proportional to the positions, and a trace's cost
# grows with them (`plan --longest-sequence` asks for millions).
BLOCK_TRACE = 16384


def block_activations(
    model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype = torch.bfloat16
) -> BlockActivations:
    if seq_len > BLOCK_TRACE:
        q, h, t = (_linear(a[0], b[0], micro_batch) for a, b in (_at(model, n, regime, low) for n in _SHORT))
        # Extended only where the short traces lie on a line (a kernel that saves T x T
        # scores, a boolean mask's math path, does not: it is traced at its length).
        if abs((t - h) - 2 * (h - q)) <= 0.01 * (t - h):
            one, two = _at(model, BLOCK_TRACE, regime, low)
            weights = _linear(one[1], two[1], micro_batch)
            saved = t + int((t - h) * (seq_len - BLOCK_TRACE) / (BLOCK_TRACE // 2))
            block_input = micro_batch * seq_len * model.hidden_size * regime_dtypes(regime, low)[1].itemsize
            return BlockActivations(saved=saved, weight_copies=weights, block_input=block_input)
    saved, weights = (_linear(a, b, micro_batch) for a, b in zip(*_at(model, seq_len, regime, low)))
    block_input = micro_batch * seq_len * model.hidden_size * regime_dtypes(regime, low)[1].itemsize
    return BlockActivations(saved=saved, weight_copies=weights, block_input=block_input)


_SHORT = (BLOCK_TRACE // 4, BLOCK_TRACE // 2, BLOCK_TRACE)


def _at(model: ModelSpec, seq_len: int, regime: str, low: torch.dtype) -> tuple[tuple[int, int], tuple[int, int]]:
    """(saved, weight copies) of a block traced at micro-batch 1 and at 2."""
    return _traced_block(model, 1, seq_len, regime, low), _traced_block(model, 2, seq_len, regime, low)


def _traceable(model: ModelSpec) -> Traceable:
    return capability(model, Traceable, "the plan (scaletrain plan, and every run's preflight)", "a spec that defines them")


def _linear(at_one: int, at_two: int, n: int) -> int:
    return at_one + (n - 1) * (at_two - at_one)


@lru_cache(maxsize=256)
def _traced_block(model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype) -> tuple[int, int]:
    # Kept across processes too (planning/trace_cache.py): the first trace of a process costs ~0.45 s.
    fields = (model, micro_batch, seq_len, regime, low)
    saved, weights = cached("block", fields, lambda: _trace_block(model, micro_batch, seq_len, regime, low))
    return saved, weights


def _trace_block(model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype) -> tuple[int, int]:
    param_dtype, act_dtype = regime_dtypes(regime, low)
    with FakeTensorMode():
        with default_dtype(param_dtype):
            block, extra = _traceable(model).traced_block(seq_len)
        _WEIGHT_SHAPES.clear()
        _WEIGHT_SHAPES.update(tuple(p.shape) for p in block.parameters() if p.dim() == 2)
        # A non-leaf input, as in the real model where each block's input is the previous
        # block's output: the block saves it (for its first norm) and it must be counted.
        x = torch.empty(micro_batch, seq_len, model.hidden_size, dtype=act_dtype, requires_grad=True).clone()
        return _trace_saved(lambda: block(x, *extra), regime)


def head_activations(
    model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype = torch.bfloat16
) -> HeadActivations:
    saved = _linear(_traced_head(model, 1, seq_len, regime, low), _traced_head(model, 2, seq_len, regime, low), micro_batch)
    tokens = micro_batch * seq_len
    logits_dtype = torch.float32 if regime == "fp32" else low
    return HeadActivations(
        saved=saved,
        logits=tokens * model.vocab_size * logits_dtype.itemsize,
        logits_fp32=tokens * model.vocab_size * 4,
    )


@lru_cache(maxsize=256)
def _traced_head(model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype) -> int:
    fields = (model, micro_batch, seq_len, regime, low)
    return int(cached("head", fields, lambda: _trace_head(model, micro_batch, seq_len, regime, low)))


def _trace_head(model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype) -> int:
    param_dtype, act_dtype = regime_dtypes(regime, low)
    with FakeTensorMode():
        with default_dtype(param_dtype):
            head = _traceable(model).traced_head()
        _WEIGHT_SHAPES.clear()
        _WEIGHT_SHAPES.update(tuple(p.shape) for p in head.parameters() if p.dim() == 2)
        x = torch.empty(micro_batch, seq_len, model.hidden_size, dtype=act_dtype, requires_grad=True).clone()
        targets = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        saved, _ = _trace_saved(lambda: model.loss(head(x), targets), regime)
    return saved
