"""One traced operation run for real on this machine and timed: how the clock measures a
CPU's rates at exactly the shapes a model uses (clock/rates.py keeps the answers).

The call's arguments are rebuilt from its trace (clock/trace.py): each tensor with the
traced shape, stride and dtype (floating point: standard normal; integers: zeros, valid
indices for any gather; booleans: true), everything else as traced. A grouped matmul's
offsets are rebuilt balanced (each group the same number of rows: the planner's routing).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

import torch

# Timing: repeats until MIN_SECONDS have passed (at least 5 calls, at most 50, after one
# warm-up), but a call slower than ENOUGH_SECONDS in all is timed fewer times: a bf16 matmul
# of the small preset's head runs 1.3 s on this project's CPU, and five of it were 8 s of one plan.
MIN_SECONDS = 0.02
ENOUGH_SECONDS = 0.25


def resolve(op: str) -> Any:
    """'aten.mm.default' -> torch.ops.aten.mm.default (scaletrain's own ops registered first)."""
    import scaletrain.models.grouped_mm  # noqa: F401  # registers scaletrain::grouped_mm

    ns, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def _tensor(spec: list[Any], generator: torch.Generator) -> torch.Tensor:
    shape, stride, dtype_name = spec
    dtype = getattr(torch, dtype_name)
    t = torch.empty_strided(shape, stride, dtype=dtype)
    if dtype.is_floating_point:
        base = torch.randn(t.untyped_storage().nbytes() // t.element_size(), generator=generator)
        t.set_(base.to(dtype).untyped_storage(), 0, shape, stride)
    elif dtype == torch.bool:
        t.fill_(True)
    else:
        t.zero_()
    return t


def _decode(value: Any, generator: torch.Generator) -> Any:
    if isinstance(value, dict):
        if "t" in value:
            return _tensor(value["t"], generator)
        if "dtype" in value:
            return getattr(torch, value["dtype"])
        if "device" in value:
            return torch.device("cpu")
        if "enum" in value:
            return getattr(torch, value["enum"])
        raise ValueError(f"cannot rebuild an argument of type {value.get('unknown')}")
    if isinstance(value, list):
        return [_decode(v, generator) for v in value]
    if value in ("inf", "-inf", "nan"):
        return float(value)
    return value


def arguments(op: str, args_json: str) -> tuple[list[Any], dict[str, Any]]:
    """The call's positional and keyword arguments, rebuilt on this machine."""
    generator = torch.Generator().manual_seed(0)
    args, kwargs = json.loads(args_json)
    args, kwargs = _decode(args, generator), {k: _decode(v, generator) for k, v in kwargs.items()}
    func = resolve(op)
    if "grouped_mm" in func.__name__:
        _balance_offsets(func, args, kwargs)
    return args, kwargs


def _balance_offsets(func: Any, args: list[Any], kwargs: dict[str, Any]) -> None:
    names = [a.name for a in func._schema.arguments]
    key = next((n for n in ("offs", "offsets") if n in names), None)
    if key is None:
        return
    i = names.index(key)
    offs = args[i] if i < len(args) else kwargs.get(key)
    if offs is None:
        return
    # The grouped dimension: the rows of a forward ([rows, k] x [groups, k, n]), the shared
    # inner dimension of a weight gradient ([k, rows] x [rows, n]).
    b = args[1]
    rows = args[0].shape[0] if b.dim() == 3 else args[0].shape[-1]
    groups = offs.numel()
    offs.copy_(torch.arange(1, groups + 1, dtype=offs.dtype) * (rows // groups))


def call_bytes(args_json: str) -> int:
    """Bytes of the tensors a call's arguments hold."""
    total = 0

    def walk(v: Any) -> None:
        nonlocal total
        if isinstance(v, dict) and "t" in v:
            shape, _, dtype = v["t"]
            total += math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    walk(json.loads(args_json))
    return total


def seconds(op: str, args_json: str) -> float:
    """The median time of one call's repeats on this machine, at this thread count (the
    median, as a run's step is measured: their least time, tried, under-predicted every
    configuration of the CPU's table by a few percent more on this shared machine); what a
    call costs in a pass beside the others, rather than alone, is measure.in_sequence's factor."""
    call = prepared(op, args_json)
    call()  # warm-up: first-touch page faults, lazy kernel initialisation
    times: list[float] = []
    spent = 0.0
    while (len(times) < 5 and spent < ENOUGH_SECONDS) or (spent < MIN_SECONDS and len(times) < 50):
        t0 = time.perf_counter()
        call()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return statistics.median(times)


def prepared(op: str, args_json: str) -> Any:
    """The call with its arguments rebuilt once, to be run (and timed) as often as wanted."""
    func = resolve(op)
    args, kwargs = arguments(op, args_json)
    return lambda: func(*args, **kwargs)
