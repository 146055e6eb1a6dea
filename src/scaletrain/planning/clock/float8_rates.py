"""train.float8's products measured for a GPU's table: torch._scaled_mm at exactly the calls the
models' float8 blocks make (clock/trace.py traces them with torchao's Float8Linear layers: the
shapes, the operands' float8 dtypes and layouts, the scales), each timed on the device
(calibrate_gpu, beside the bf16 sweep). The clock prices a float8 product from these rows by
its first operand's dtype (clock/rates.py `_matmul_rate`: e4m3 in forward, e5m2 where the
output gradient leads in backward); a table without them falls back to bf16's rate times the
datasheet's float8 peak over bf16's, and the plan says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from scaletrain.planning.clock.replay import arguments, resolve
from scaletrain.planning.clock.trace import Call, block_work, float8_traceable

SCALED_MM = "aten._scaled_mm.default"


def float8_calls(models: list[Any], tokens: tuple[int, ...]) -> dict[tuple[str, int, int, int], Call]:
    """(first operand's dtype, M, N, K) -> one traced call of torch._scaled_mm with them, over
    the float8 blocks of `models` (FSDP's regime, bf16) at each of `tokens` tokens, forward and backward."""
    calls: dict[tuple[str, int, int, int], Call] = {}
    for model in models:
        for n in tokens:
            work = block_work(model, 1, n, "pure16", torch.bfloat16, float8=True)
            for p in (work.forward, work.backward):
                for c in p.calls:
                    if c.op == SCALED_MM:
                        _, m, n, k = c.shape[:4]
                        calls.setdefault((c.dtype, m, n, k), c)
    return calls


def float8_rows(
    models: list[Any], device: str, timed: Callable[[Callable[[], Any]], float], tokens: tuple[int, ...] = (2048, 16384)
) -> dict[str, list[list[float]]]:
    """The table's float8 rows, {dtype: [[M, N, K, FLOP/s], ...]}: each call of `float8_calls`
    rebuilt on `device` (replay's arguments: random float8 operands in the traced layout, the
    scales) and its seconds from `timed` (calibrate_gpu: back to back, as a step runs them).
    Empty where torchao, which the trace needs, is not installed."""
    if not float8_traceable():
        return {}
    rows: dict[str, list[list[float]]] = {}
    func = resolve(SCALED_MM)
    for (dtype, m, n, k), call in sorted(float8_calls(models, tokens).items()):
        args, kwargs = arguments(call.op, call.args)
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        kwargs = {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}
        seconds = timed(lambda: func(*args, **kwargs))  # noqa: B023 - timed within this iteration
        rows.setdefault(dtype, []).append([m, n, k, 2.0 * m * n * k / seconds])
    return rows
