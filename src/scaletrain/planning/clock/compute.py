"""The compute of one micro-batch on one rank: the traced operations (clock/trace.py) at the
rates of the device (clock/rates.py), forward and backward, with what the layout changes.

- Eager: every call at its rate; the host's cost per dispatched operation beside it. A CPU
  runs both one after the other; a GPU's host queues kernels ahead, so a pass takes the
  longer of its kernels and its host work.
- `train.compile`: matmuls and attention as eager, the memory-bound work as the fused
  kernels the trace found (their bytes at the memory bandwidth), and inductor's compiled
  graph dispatches a kernel, not an aten operation, per fused group (the host's share); the
  blocks and, where the loss is chunked, the loss's chunks (each one compiled kernel).
- activation checkpointing: each block's forward again in backward (its operations as they
  ran); train.tile_tokens: each feed-forward's forward again in backward.
- tensor parallel: the built-in model's rank holds n_heads / tp heads, ffn_dim / tp of the
  feed-forward and vocab_size / tp of the head, so its block is traced at that shape;
  another model's rank runs 1/tp of each traced pass, but a mixture of experts' layers,
  which run whole on every tp rank, the share of the FLOPs they hold. DTensor dispatches each operation through Python: the host's
  cost per operation is the one measured under tensor parallel (clock/calibrate.py).
- context parallel: a rank holds seq_len / cp of each sequence: its matmuls and memory-bound
  work are traced at that length; its attention is 1/cp of the whole sequence's (the
  all-gather design's query chunks are balanced; Ulysses holds 1/cp of the heads whole).
- a micro-batch of more than EXACT_TOKENS tokens, or longer sequences than BLOCK_TRACE, is
  traced at a share of them and scaled: matmuls and memory-bound work by the tokens (their
  rates at the traced shapes, where a GPU's matmuls already run near their best), attention
  by the micro-batch and the square of the length, the host's dispatching not at all.
- a pipeline: a rank runs its stages' blocks (the cut of pipeline.rank_share) and, on the
  first and last stage, the embedding and head: the balanced cut gives each rank about
  1/pp of the whole, so the whole is divided by pp.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from scaletrain.models.spec import LlamaSpec, ModelSpec, with_fields
from scaletrain.planning.activations import BLOCK_TRACE
from scaletrain.planning.clock import cpu_measured
from scaletrain.planning.clock.rates import Rates
from scaletrain.planning.clock.trace import Pass, block_work, embedding_work, float8_traceable, head_work
from scaletrain.planning.experts import repeated_under_tp
from scaletrain.planning.memory import ffn_width, regime
from scaletrain.planning.setup import Setup


@dataclass(frozen=True)
class Part:
    """Seconds one pass of one unit takes, and what is in it."""

    seconds: float
    host: float  # of which (a CPU) or beside which (a GPU): the host's dispatching
    largest: tuple[tuple[str, float], ...]  # its costliest calls (label, seconds), for --explain-time


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on one rank: forward and backward, each with its largest calls."""

    forward: float
    backward: float
    largest_forward: tuple[tuple[str, float], ...]
    largest_backward: tuple[tuple[str, float], ...]
    ops: int  # aten operations dispatched in the micro-batch
    matmul_s: float  # of forward + backward: in matmuls (float8 and tiles scale these)
    host_forward: float = 0.0  # the host's dispatching in forward and backward (a GPU: beside its kernels)
    host_backward: float = 0.0


def low_dtype(precision: str) -> torch.dtype:
    return torch.float16 if precision == "fp16" else torch.bfloat16


@dataclass(frozen=True)
class Priced:
    """A pass at a rate, before any scaling: what `price` scales (kept per pass and rates)."""

    work: float  # device seconds of its matmuls and memory-bound work (compiled: the fused kernels)
    attention: float  # device seconds of its attention
    kernels: int  # what the host dispatches: every aten operation, or (compiled) every kernel
    items: tuple[tuple[str, float, bool], ...]  # its costliest calls (label, seconds, attention?)


_PRICED: dict[tuple[int, int, bool, int | None, str], tuple[Pass, Rates, Priced]] = {}


def forget() -> None:
    """Drop what was priced (the rates it was priced at are measured again: bench/clock.py)."""
    _PRICED.clear()
    _MATMULS.clear()


def priced(p: Pass, rates: Rates, compiled: bool, length: int | None = None, kernel: str = "auto") -> Priced:
    """`p`'s calls at `rates`; `length`: the sequence its attention runs at, where it was
    traced at a shorter one (the kernel's rate at that length: Rates.call); `kernel`:
    train.attention_kernel."""
    key = (id(p), id(rates), compiled, length, kernel)
    hit = _PRICED.get(key)
    if hit is not None and hit[0] is p and hit[1] is rates:
        return hit[2]
    busy = cpu_measured.BUSY_USED[0]
    work = attention = 0.0
    items: list[tuple[object, float, bool]] = []
    for c in p.calls:
        if compiled and c.kind == "memory":
            continue
        seconds = rates.call(c, length, kernel) * c.count
        if c.kind == "attention":
            attention += seconds
        else:
            work += seconds
        items.append((c, seconds, c.kind == "attention"))
    kernels = p.dispatched
    if compiled and p.fused_kernels:
        fused = rates.fused(p.fused_bytes, p.fused_kernels)
        work += fused
        items.append((f"fused memory-bound kernels ({p.fused_kernels}, {p.fused_bytes / 2**20:.0f} MiB)", fused, False))
        kernels = sum(c.count for c in p.calls if c.kind != "memory") + p.fused_kernels
    items.sort(key=lambda x: -x[1])
    labelled = _merge_labels([(_label(c) if not isinstance(c, str) else c, s, a) for c, s, a in items[:12]])
    out = Priced(work, attention, kernels, labelled[:5])
    if cpu_measured.BUSY_USED[0] != busy:
        return out  # priced with a time taken on a busy machine: asked for again (cpu_measured.py)
    if len(_PRICED) > 4096:
        _PRICED.clear()
    _PRICED[key] = (p, rates, out)
    return out


def price(
    p: Pass,
    rates: Rates,
    compiled: bool,
    scale: float = 1.0,
    attention_scale: float = 1.0,
    host_op: float | None = None,
    length: int | None = None,
    kernel: str = "auto",
) -> Part:
    """One pass: its calls at `rates`, matmuls and memory-bound work x `scale` (tensor
    parallel's share, and the tokens over the traced ones), attention x `attention_scale`
    at its rate for `length` (the sequence as it runs, where traced shorter); `host_op`: the
    host's cost per operation where not the plain one (tensor parallel's DTensor). The
    host's dispatching does not scale: the same operations, larger."""
    x = priced(p, rates, compiled, length, kernel)
    device = x.work * scale + x.attention * attention_scale
    host = x.kernels * (rates.host_op if host_op is None else host_op)
    seconds = max(device, host) if rates.asynchronous else device + host
    largest = tuple((label, s * (attention_scale if att else scale)) for label, s, att in x.items)
    return Part(seconds, host, tuple(sorted(largest, key=lambda x: -x[1])))


def _label(c: object) -> str:
    from scaletrain.planning.clock.trace import Call

    assert isinstance(c, Call)
    name = c.op.split(".")[1]
    if c.kind == "matmul":
        g, m, n, k = c.shape
        return f"{name} {m}x{n}x{k}" + (f" x{g}" if g > 1 else "")
    if c.kind == "attention":
        bh, tq, tk, d, causal = c.shape
        return f"{name} {bh} heads x {tq}x{tk}, head {d}" + (" causal" if causal else "")
    return name


def _merge_labels(items: list[tuple[str, float, bool]]) -> tuple[tuple[str, float, bool], ...]:
    merged: dict[tuple[str, bool], float] = {}
    for label, s, att in items:
        merged[(label, att)] = merged.get((label, att), 0.0) + s
    return tuple(sorted(((label, s, att) for (label, att), s in merged.items()), key=lambda x: -x[1]))


def tp_rank_model(model: ModelSpec, tp: int) -> ModelSpec | None:
    """The built-in model as one tensor-parallel rank holds it (module docstring), or None."""
    if tp == 1 or not isinstance(model, LlamaSpec) or model.shape.experts:
        return None
    shape = model.shape
    local = replace(
        shape,
        n_heads=shape.n_heads // tp,
        n_kv_heads=shape.n_kv_heads // tp,
        ffn_dim=shape.ffn_dim // tp,
        vocab_size=shape.vocab_size // tp,
        attention_head_dim=shape.head_dim,
    )
    return with_fields(model, shape=local)


# A micro-batch of more tokens than this (or sequences longer than BLOCK_TRACE) is priced
# from its trace at a share of them: its matmuls and memory-bound work scale with the
# tokens, its attention with the micro-batch and the square of the length (module docstring).
EXACT_TOKENS = 16384


@dataclass(frozen=True)
class Scale:
    """How the traced micro-batch stands to the one priced."""

    micro_batch: int  # traced at
    seq_len: int
    tokens: float  # the priced tokens over the traced ones
    attention: float  # the priced attention over the traced one


def float8_traced(s: Setup) -> bool:
    """Whether layout `s` is priced from a trace of its float8 block (train.float8 with torchao
    installed: clock/trace.py), rather than from the datasheets' float8 peaks (clock/engines.py)."""
    return s.float8 and float8_traceable()


def traced_size(micro_batch: int, seq_len: int, cp: int = 1) -> Scale:
    """The size a micro-batch of `micro_batch` x `seq_len` (a rank's share of each sequence
    under cp, whose attention spans cp times that) is traced at, and how it scales."""
    t = min(seq_len, BLOCK_TRACE)
    mb = max(1, min(micro_batch, EXACT_TOKENS // t))
    tokens = micro_batch * seq_len / (mb * t)
    return Scale(mb, t, tokens, micro_batch / mb * cp * (seq_len / t) ** 2)


def micro_batch(model: ModelSpec, s: Setup, rates: Rates, compiled: bool, kernel: str = "auto") -> MicroBatch:
    """Forward and backward of one micro-batch on one rank (module docstring); `kernel`:
    train.attention_kernel, the attention's rates."""
    reg, low = regime(s.strategy, s.precision), low_dtype(s.precision)
    host_op = rates.host_op_tp if s.tp > 1 else rates.host_op
    split = tp_rank_model(model, s.tp)
    if split is not None:
        model, s = split, replace(s, tp=1)
    size = traced_size(s.micro_batch, s.local_seq_len, s.cp)
    # train.float8: the block traced with torchao's Float8Linear layers, where torchao is here
    # (their float8 products and casts priced as each other call); else step.py's estimate.
    block = block_work(model, size.micro_batch, size.seq_len, reg, low, float8=float8_traced(s))
    head = head_work(model, size.micro_batch, size.seq_len, reg, low)
    emb = embedding_work(model, size.micro_batch, size.seq_len, reg, low)
    tp_share = 1.0 / s.tp
    if s.tp > 1 and repeated_under_tp(model):
        # A mixture of experts' layers run whole on every tp rank over the tp group's tokens
        # (models/llama_tp.py): their share of the FLOPs is not divided by tp.
        moe = min(1.0, repeated_under_tp(model) / model.flops_per_token(s.seq_len))
        tp_share = (1 - moe) / s.tp + moe
    # Context parallel: a rank's attention is 1/cp of the whole sequence's (Scale.attention).
    work, attention = tp_share * size.tokens, size.attention / s.tp
    blocks = model.n_blocks / s.pp
    # The attention kernel runs over the whole sequence (context parallel: every rank's queries
    # against all of it), however short the trace: its rate is the one at that length.
    length = s.seq_len if s.seq_len > size.seq_len else None
    bf = price(block.forward, rates, compiled, work, attention, host_op, length, kernel)
    bb = price(block.backward, rates, compiled, work, attention, host_op, length, kernel)
    ends = 1.0 / s.pp  # the head and the embedding: one stage's each, spread as the cut balances them
    # Compiled, the chunked loss is too (models/loss.py: each chunk's forward and backward one
    # kernel, reading the logits once and writing their gradient once): the head's memory-bound
    # work is priced fused, its final norm (eager, ~1% of that traffic) with it.
    loss_fused = compiled and model.loss_chunk_tokens > 0
    hf, hb = (price(p, rates, loss_fused, work, host_op=host_op) for p in (head.forward, head.backward))
    ef, eb = (price(p, rates, False, work, host_op=host_op) for p in (emb.forward, emb.backward))
    forward = blocks * bf.seconds + ends * (hf.seconds + ef.seconds)
    backward = blocks * bb.seconds + ends * (hb.seconds + eb.seconds)
    if s.activation_checkpointing:
        # The forward again, up to the last tensor the backward reads (trace.py); selective:
        # of that, what the policy does not keep (models/selective_ac.py).
        repeated = block.selective if s.selective else block.recompute
        again = bf if repeated is None else price(repeated, rates, compiled, work, attention, host_op, length, kernel)
        backward += blocks * again.seconds
    matmuls = blocks * (_matmul_seconds(block.forward, rates, work) + _matmul_seconds(block.backward, rates, work))
    if s.tile_tokens:
        backward += blocks * _ffn_forward_seconds(model, block.forward, rates, work)
    if s.teacher is not None:
        forward += teacher_forward(s.teacher, s, rates, compiled)
    ops = int(blocks * (block.forward.dispatched + block.backward.dispatched)) + sum(
        p.dispatched for p in (head.forward, head.backward, emb.forward, emb.backward)
    )
    fl = _top(("block", blocks, bf), ("head", ends, hf), ("embedding", ends, ef))
    bl = _top(("block", blocks, bb), ("head", ends, hb), ("embedding", ends, eb))
    host_forward = blocks * bf.host + ends * (hf.host + ef.host)
    host_backward = blocks * bb.host + ends * (hb.host + eb.host)
    return MicroBatch(forward, backward, fl, bl, ops, matmuls, host_forward, host_backward)


def _matmul_seconds(p: Pass, rates: Rates, share: float) -> float:
    return _matmuls(p, rates) * share


_MATMULS: dict[tuple[int, int], tuple[Pass, float]] = {}


def _matmuls(p: Pass, rates: Rates) -> float:
    hit = _MATMULS.get((id(p), id(rates)))
    if hit is not None and hit[0] is p:
        return hit[1]
    seconds = sum(rates.call(c) * c.count for c in p.of("matmul"))
    if len(_MATMULS) > 4096:
        _MATMULS.clear()
    _MATMULS[(id(p), id(rates))] = (p, seconds)
    return seconds


def _ffn_forward_seconds(model: ModelSpec, forward: Pass, rates: Rates, share: float) -> float:
    """A block's feed-forward forward: its share of the block's forward matmul FLOPs at the
    rate those matmuls ran (train.tile_tokens recomputes it in backward)."""
    shape = getattr(model, "shape", None)
    mm = forward.of("matmul")
    flops = sum(c.flops * c.count for c in mm)
    if shape is None or not flops:
        return 0.0
    seconds = _matmul_seconds(forward, rates, share)
    tokens = mm[0].shape[1] if mm and len(mm[0].shape) >= 2 else 0
    ffn = 2.0 * 3 * shape.dim * ffn_width(shape) * tokens
    return seconds * min(1.0, ffn / flops)


def teacher_forward(teacher: ModelSpec, s: Setup, rates: Rates, compiled: bool) -> float:
    """A frozen teacher's forward (model.teacher): its blocks and head, no backward."""
    reg, low = regime(s.strategy, s.precision), low_dtype(s.precision)
    block = block_work(teacher, s.micro_batch, s.local_seq_len, reg, low)
    head = head_work(teacher, s.micro_batch, s.local_seq_len, reg, low)
    return (
        teacher.n_blocks / s.pp * price(block.forward, rates, compiled).seconds + price(head.forward, rates, False).seconds / s.pp
    )


def _top(*parts: tuple[str, float, Part]) -> tuple[tuple[str, float], ...]:
    items = [(f"{unit}: {label}" + (f" x{n:g}" if n != 1 else ""), n * sec) for unit, n, p in parts for label, sec in p.largest]
    return tuple(sorted(items, key=lambda x: -x[1])[:5])
