"""The operations a training step runs, read from the model's own code.

One block, the head (final norm, output projection, loss) and the embedding run forward and
backward on fake tensors (FakeTensorMode: real shapes, dtypes and kernel choices, no
memory), under the engine's precision regime, as planning/activations.py traces what they
save. A dispatch mode records every aten operation the two passes dispatch: its name, its
arguments (tensors as shape, stride and dtype), the FLOPs of a matmul or an attention
kernel, and the bytes every other operation reads and writes. The clock (clock/step.py)
prices each at a measured rate (clock/rates.py); nothing here is a formula of the model.

`torch.compile` fuses the memory-bound work between two matmuls into one kernel: what
such a kernel moves is the tensors that enter it from elsewhere (a matmul's output, the
block's input) and those leaving it for elsewhere (a matmul, the pass's output, the
backward). `fusion` groups each pass's memory-bound operations by that data flow and
counts those bytes: inductor's own grouping is finer in places (a reduction it splits),
so this is the least traffic a compiled pass can have.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from scaletrain.models import selective_ac
from scaletrain.models.capabilities import Traceable, capability
from scaletrain.models.float8 import convert_linears
from scaletrain.models.grouped_mm import grouped_on_fake_tensors
from scaletrain.models.spec import ModelSpec
from scaletrain.planning.activations import default_dtype, regime_dtypes
from scaletrain.planning.trace_cache import OPS_FILE, cached

aten = torch.ops.aten
# Matrix products and how many multiply-adds each does, from its tensor arguments;
# scaletrain::grouped_mm is torch._grouped_mm behind a custom op (models/grouped_mm.py), which
# fake tensors dispatch whole.
# torch._scaled_mm is train.float8's product (torchao's Float8Linear: float8 operands, a scale
# each, a bf16 output).
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "grouped_mm", "_scaled_mm"}
_NAMESPACES = ("aten", "scaletrain")
# Kernels that allocate only: no bytes move (their cost is the dispatch).
_ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
# Operations that return a view or metadata without a kernel though their schema says otherwise.
_FREE = {"_unsafe_view", "detach", "lift_fresh", "alias", "_reshape_alias", "set_"}


@dataclass(frozen=True)
class Call:
    """One kind of aten operation a pass runs, `count` times with these arguments."""

    op: str  # "aten.mm.default"
    kind: str  # "matmul" | "attention" | "memory"
    args: str  # the arguments as JSON (clock/replay.py rebuilds them; also the call's identity)
    flops: float  # per call: 2 x multiply-adds (matmul, attention as the kernel runs them)
    nbytes: float  # per call: bytes of the tensors read and written
    count: int = 1
    shape: tuple[int, ...] = ()  # matmul: (groups, M, N, K); attention: (batch x heads, Tq, Tk, head dim, causal)
    dtype: str = "float32"  # of its first tensor argument (the rate's table is by dtype)


Record = tuple[Call, tuple[int, ...], tuple[int, ...]]  # a call with its input and output storages

# Where a matrix product's two operands are among its arguments (addmm and baddbmm: after the bias).
_OPERANDS = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1, "_scaled_mm": 0}


def tensor_layouts(args: str) -> list[tuple[list[int], list[int]] | None]:
    """The shape and strides of each positional argument of a traced call (its `args` JSON),
    None where that argument is not a tensor."""
    return [a["t"][:2] if isinstance(a, dict) and "t" in a else None for a in json.loads(args)[0]]


@lru_cache(maxsize=4096)
def matmul_layout(op: str, args: str) -> str:
    """A matrix product's operand layout, as cuBLAS meets it: "n" for a row-major operand, "t"
    for a transposed view (its last stride not 1), the two side by side. nn.Linear's forward is
    "nt" (x @ W.T), its weight gradient "tn" (grad.T @ x), its input gradient "nn": the same
    shape runs at another rate in each (a GPU's table measures them apart: clock/calibrate.py)."""
    first = _OPERANDS.get(op.split(".")[1] if op.startswith("aten.") else op)
    if first is None:
        return "nn"
    try:
        layouts = tensor_layouts(args)[first : first + 2]
        return "".join("t" if len(shape) >= 2 and stride[-1] != 1 and shape[-1] > 1 else "n" for shape, stride in layouts)  # type: ignore[misc]
    except (ValueError, LookupError, TypeError):  # a call built without its traced arguments
        return "nn"


@dataclass(frozen=True)
class Pass:
    """One pass (forward or backward) of one traced unit."""

    calls: tuple[Call, ...]
    dispatched: int  # every aten operation dispatched, views included: the host's share
    fused_bytes: float  # compiled: the bytes the fused memory-bound kernels move (module docstring)
    fused_kernels: int  # compiled: how many such kernels

    def of(self, kind: str) -> list[Call]:
        return [c for c in self.calls if c.kind == kind]


@dataclass(frozen=True)
class Traced:
    forward: Pass
    backward: Pass
    # The forward's operations checkpointing repeats in backward: all of them up to the last
    # that makes a tensor the backward reads (`recompute`); under selective checkpointing
    # (models/selective_ac.py) those of them the policy does not keep, and the bytes of the
    # outputs it keeps instead.
    recompute: Pass | None = None
    selective: Pass | None = None
    selective_saved: float = 0.0


def _name(func: Any) -> str:
    return func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)


def _encode(value: Any) -> Any:
    """A JSON-able description of an argument (tensors by shape, stride and dtype)."""
    if isinstance(value, torch.Tensor):
        return {"t": [list(value.shape), list(value.stride()), str(value.dtype).removeprefix("torch.")]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": value.type}
    if isinstance(value, (torch.layout, torch.memory_format)):
        return {"enum": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if not (isinstance(value, float) and not math.isfinite(value)) else str(value)
    return {"unknown": type(value).__name__}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _bytes(ts: list[torch.Tensor]) -> int:
    """Bytes of the distinct tensors among `ts` (a tensor passed twice is read once)."""
    seen, total = set(), 0
    for t in ts:
        key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _named(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by their schema names."""
    out = dict(kwargs)
    for a, v in zip(func._schema.arguments, args):
        out[a.name] = v
    return out


def _matmul_shape(name: str, named: dict[str, Any], out: torch.Tensor) -> tuple[int, int, int, int]:
    """(groups, M, N, K) of a matrix product."""
    if name in ("_grouped_mm", "grouped_mm"):
        # Offsets on the rows ([M, K] x [G, K, N] -> [M, N]: each row through its group's
        # weight): 2 M N K. On the reduction ([K, S] x [S, N] -> [G, K, N], a weight gradient,
        # each group over its own slots S_g): 2 K N S, the slots summed over the groups.
        a = named.get("self", named.get("a"))
        assert a is not None
        if out.dim() == 3:
            return 1, out.shape[-2], out.shape[-1], a.shape[-1]
        return 1, out.shape[0], out.shape[-1], a.shape[-1]
    a = named.get("mat1", named.get("self"))
    b = named.get("mat2")
    assert a is not None and b is not None
    if a.dim() == 3:  # bmm, baddbmm
        return a.shape[0], a.shape[1], b.shape[2], a.shape[2]
    return 1, a.shape[0], b.shape[1], a.shape[1]


def _attention(name: str, named: dict[str, Any]) -> tuple[tuple[int, ...], float] | None:
    """(batch x heads, Tq, Tk, head dim, causal) and FLOPs of an attention kernel's call:
    forward 2 products (scores, values), backward 5 (scores again, and the gradients of
    values, probabilities, queries and keys), of 2 x Tq x Tk x head dim each; a causal mask
    leaves the kernel the lower triangle."""
    q, k = named.get("query"), named.get("key")
    if q is None or k is None:
        return None
    bh, tq, tk, d = q.numel() // (q.shape[-1] * q.shape[-2]), q.shape[-2], k.shape[-2], q.shape[-1]
    causal = bool(named.get("is_causal", False))
    pairs = tq * tk if not causal else tq * (tq + 1) / 2 + max(0, tk - tq) * tq
    products = 5 if "backward" in name else 2
    return (bh, tq, tk, d, int(causal)), products * 2.0 * bh * pairs * d


class _Recorder(TorchDispatchMode):
    """Records every aten operation dispatched while active (fake tensors underneath)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Record] = []
        self.dispatched = 0
        self.keep: list[torch.Tensor] = []  # storages stay alive: their ids are not reused
        self.sizes: dict[int, int] = {}  # storage -> bytes (of the largest tensor seen on it)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        wrapped = [t for t in _tensors((args, kwargs)) if is_traceable_wrapper_subclass(t)]
        if wrapped:
            # A tensor subclass (train.float8's Float8TrainingTensor: float8 data and its scale)
            # reaches a mode before its own dispatch, as one operation in the dtype it stands
            # for: its own dispatch is what runs (the float8 product, torch._scaled_mm, and the
            # copies that lay its operands out), so that runs here with this mode entered
            # again, which records those operations instead.
            with self:
                return type(wrapped[0]).__torch_dispatch__(func, types, args, kwargs)
        out = func(*args, **kwargs)
        if func.namespace not in _NAMESPACES:
            return out
        self.dispatched += 1
        name = _name(func)
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        self.keep += ins + outs
        for t in ins + outs:
            key = t.untyped_storage()._cdata
            self.sizes[key] = max(self.sizes.get(key, 0), t.numel() * t.element_size())
        aliasing = any(r.alias_info is not None for r in func._schema.returns) and not func._schema.is_mutable
        if aliasing or name in _FREE or not outs and not ins:
            return out
        named = _named(func, args, kwargs)
        args_json = _dumps([_encode(args), {k: _encode(v) for k, v in kwargs.items()}])
        shape: tuple[int, ...] = ()
        if name in _MATMULS:
            g, m, n, k = _matmul_shape(name, named, outs[0])
            kind, flops, shape = "matmul", 2.0 * g * m * n * k, (g, m, n, k)
        elif "attention" in name or "scaled_dot_product" in name:
            found = _attention(name, named)
            kind, flops = ("attention", found[1]) if found else ("memory", 0.0)
            shape = found[0] if found else ()
        else:
            kind, flops = "memory", 0.0
        nbytes = 0.0 if name in _ALLOCATIONS else float(_bytes(ins) + _bytes(outs))
        dtype = str(ins[0].dtype).removeprefix("torch.") if ins else "float32"
        call = Call(str(func), kind, args_json, flops, nbytes, 1, shape, dtype)
        storages = tuple(t.untyped_storage()._cdata for t in ins), tuple(t.untyped_storage()._cdata for t in outs)
        self.calls.append((call, *storages))
        return out


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _merged(calls: list[Call]) -> tuple[Call, ...]:
    """Identical calls (same operation and arguments) as one, counted."""
    out: dict[tuple[str, str], Call] = {}
    for c in calls:
        key = (c.op, c.args)
        prev = out.get(key)
        out[key] = c if prev is None else Call(c.op, c.kind, c.args, c.flops, c.nbytes, prev.count + 1, c.shape, c.dtype)
    return tuple(out.values())


def fusion(records: list[Record], sizes: dict[int, int], later: set[int]) -> tuple[float, int]:
    """(bytes, kernels) of the fused memory-bound kernels of one pass (module docstring):
    memory-bound operations joined where one consumes another's output; each group reads the
    storages made outside it and writes those used outside it (by a matmul or attention, by
    a later pass: `later`, or by nobody within the pass: its outputs)."""
    parent: dict[int, int] = {}

    def find(i: int) -> int:
        while parent.setdefault(i, i) != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    maker: dict[int, int] = {}  # storage -> the memory-bound call that wrote it last
    used_outside: set[int] = set(later)
    memory = []
    for i, (call, ins, outs) in enumerate(records):
        if call.kind != "memory" or not call.nbytes:
            used_outside.update(ins)
            continue
        memory.append(i)
        find(i)
        for s in ins:
            if s in maker:
                parent[find(i)] = find(maker[s])
        for s in outs:
            maker[s] = i
    groups: dict[int, list[int]] = {}
    for i in memory:
        groups.setdefault(find(i), []).append(i)
    consumed = {s for _, ins, _ in records for s in ins}
    total = 0.0
    for members in groups.values():
        made = {s for i in members for s in records[i][2]}
        read = {s for i in members for s in records[i][1]} - made
        written = {s for s in made if s in used_outside or s not in consumed}
        total += sum(sizes.get(s, 0) for s in read | written)
    return total, len(groups)


def _passes(run: Callable[[], torch.Tensor]) -> Traced:
    """Forward then backward of `run`'s output (a seed gradient of ones), recorded apart."""
    fwd = _Recorder()
    with fwd:
        out = run()
    seed = torch.ones_like(out)  # the gradient arriving from the next unit: not this unit's work
    bwd = _Recorder()
    with bwd:
        out.backward(seed)
    later = {s for _, ins, _ in bwd.calls for s in ins}
    f_bytes, f_kernels = fusion(fwd.calls, fwd.sizes, later)
    b_bytes, b_kernels = fusion(bwd.calls, bwd.sizes, set())
    # Checkpointing's recompute stops once it has made every tensor the backward reads (torch's
    # early stop, on by default): the operations after the last that makes one (a block's last
    # product and its residual add) do not run again. (Read from the backward's inputs, not
    # from saved-tensor hooks, which would change what the passes dispatch.)
    last = max((i for i, (_, _, outs) in enumerate(fwd.calls) if later.intersection(outs)), default=-1)
    prefix = fwd.calls[: last + 1]
    # Selective checkpointing, the engines' rule walked over the forward in its order: the
    # calls it recomputes (their fused kernels read what the kept outputs and the block's
    # input hold), and the bytes of the outputs it keeps.
    counter = selective_ac.Counter()
    kept = [counter.saves(r[0].op) for r in fwd.calls]
    again = [r for r, k in zip(prefix, kept, strict=False) if not k]
    saved = sum(fwd.sizes.get(o, 0) for r, k in zip(fwd.calls, kept, strict=True) if k for o in set(r[2]))
    return Traced(
        Pass(_merged([c for c, _, _ in fwd.calls]), fwd.dispatched, f_bytes, f_kernels),
        Pass(_merged([c for c, _, _ in bwd.calls]), bwd.dispatched, b_bytes, b_kernels),
        _part(fwd, prefix, later),
        _part(fwd, again, later),
        float(saved),
    )


def _part(fwd: _Recorder, records: list[Record], later: set[int]) -> Pass:
    """The pass of `records`, a part of the forward `fwd` recorded: what a recompute runs."""
    fused, kernels = fusion(records, fwd.sizes, later)
    dispatched = round(fwd.dispatched * len(records) / max(1, len(fwd.calls)))
    return Pass(_merged([c for c, _, _ in records]), dispatched, fused, kernels)


def _autocast(regime: str, low: torch.dtype) -> Any:
    return torch.autocast("cpu", dtype=low) if regime == "autocast" else torch.autocast("cpu", enabled=False)


def _traceable(model: ModelSpec) -> Traceable:
    return capability(model, Traceable, "the plan (scaletrain plan, and every run's preflight)", "a spec that defines them")


def _first(out: Any) -> torch.Tensor:
    """A block's hidden states (a mixture of experts' block returns them with its aux terms)."""
    return out[0] if isinstance(out, tuple) else out


@lru_cache(maxsize=512)
def block_work(
    model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype = torch.bfloat16, float8: bool = False
) -> Traced:
    """One block's forward and backward at micro_batch x seq_len tokens; `float8`: its Linear
    layers as train.float8 converts them (torchao's Float8Linear, `float8_traceable`)."""
    kind = "block-ops-float8" if float8 else "block-ops"
    return _cached(
        kind, model, micro_batch, seq_len, regime, low, lambda: _trace_block(model, micro_batch, seq_len, regime, low, float8)
    )


def float8_traceable() -> bool:
    """Whether a float8 block can be traced here: torchao (the float8 extra) is installed."""
    from importlib.util import find_spec

    return find_spec("torchao") is not None


@lru_cache(maxsize=512)
def head_work(model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype = torch.bfloat16) -> Traced:
    """The final norm, output projection and loss, forward and backward."""
    return _cached(
        "head-ops", model, micro_batch, seq_len, regime, low, lambda: _trace_head(model, micro_batch, seq_len, regime, low)
    )


@lru_cache(maxsize=512)
def embedding_work(model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype = torch.bfloat16) -> Traced:
    """The token embedding's lookup and its dense gradient."""
    return _cached(
        "embedding-ops",
        model,
        micro_batch,
        seq_len,
        regime,
        low,
        lambda: _trace_embedding(model, micro_batch, seq_len, regime, low),
    )


def _cached(
    kind: str, model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype, trace: Callable[[], Traced]
) -> Traced:
    raw = cached(kind, (model, micro_batch, seq_len, regime, low), lambda: _to_json(trace()), OPS_FILE)
    return _from_json(raw)


def _to_json(t: Traced) -> dict[str, Any]:
    def one(p: Pass | None) -> dict[str, Any] | None:
        if p is None:
            return None
        return {
            "calls": [[c.op, c.kind, c.args, c.flops, c.nbytes, c.count, list(c.shape), c.dtype] for c in p.calls],
            "dispatched": p.dispatched,
            "fused_bytes": p.fused_bytes,
            "fused_kernels": p.fused_kernels,
        }

    return {
        "forward": one(t.forward),
        "backward": one(t.backward),
        "recompute": one(t.recompute),
        "selective": one(t.selective),
        "selective_saved": t.selective_saved,
    }


def _from_json(raw: dict[str, Any]) -> Traced:
    def one(p: dict[str, Any]) -> Pass:
        calls = tuple(
            Call(op, kind, args, flops, nbytes, count, tuple(shape), dtype)
            for op, kind, args, flops, nbytes, count, shape, dtype in p["calls"]
        )
        return Pass(calls, p["dispatched"], p["fused_bytes"], p["fused_kernels"])

    def maybe(key: str) -> Pass | None:
        return one(raw[key]) if raw.get(key) else None

    return Traced(
        one(raw["forward"]), one(raw["backward"]), maybe("recompute"), maybe("selective"), raw.get("selective_saved", 0.0)
    )


def _trace_block(model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype, float8: bool) -> Traced:
    param_dtype, act_dtype = regime_dtypes(regime, low)
    # A mixture of experts' experts as the devices run them under experts_impl=auto: grouped.
    with FakeTensorMode(), grouped_on_fake_tensors():
        with default_dtype(param_dtype):
            block, extra = _traceable(model).traced_block(seq_len)
        if float8:
            # The engines' conversion (models/float8.py), without FSDP's float8 all-gather: each
            # weight is cast in the pass that uses it, as under ddp (under FSDP over NCCL the
            # shard is cast once per all-gather instead: a few percent of the casts' bytes).
            convert_linears(block, block, fsdp_gather=False)
        x = torch.empty(micro_batch, seq_len, model.hidden_size, dtype=act_dtype, requires_grad=True).clone()
        with _autocast(regime, low):
            return _passes(lambda: _first(block(x, *extra)))


def _trace_head(model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype) -> Traced:
    param_dtype, act_dtype = regime_dtypes(regime, low)
    with FakeTensorMode():
        with default_dtype(param_dtype):
            head = _traceable(model).traced_head()
        x = torch.empty(micro_batch, seq_len, model.hidden_size, dtype=act_dtype, requires_grad=True).clone()
        targets = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        with _autocast(regime, low):
            return _passes(lambda: model.loss(head(x), targets))


def _trace_embedding(model: ModelSpec, micro_batch: int, seq_len: int, regime: str, low: torch.dtype) -> Traced:
    param_dtype, _ = regime_dtypes(regime, low)
    with FakeTensorMode():
        with default_dtype(param_dtype):
            table = torch.nn.Embedding(model.vocab_size, model.hidden_size)
        tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        return _passes(lambda: table(tokens))
