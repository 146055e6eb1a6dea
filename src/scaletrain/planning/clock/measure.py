"""The microbenchmarks the clock's rates are measured with (clock/rates.py measures a CPU's
on first use, clock/calibrate.py a machine's for `scaletrain plan --calibrate`): each a
median of repeats after a warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from scaletrain.planning.clock.trace import block_work


def median_seconds(fn: Callable[[], Any], repeats: int = 7, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: str = "cpu") -> float:
    """Bytes per second (read and write counted) of copying 64 MiB."""
    n = 16 << 20
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    return 2 * 4 * n / median_seconds(lambda: dst.copy_(src), sync=sync)


def optimizer_seconds(params: int, tensors: int, device: str = "cpu", cap: int = 32 << 20) -> float:
    """One AdamW step (fused where torch has the kernel) and gradient clipping over `params`
    fp32 parameters in `tensors` equal tensors, as the engines step (engines/torch_engine.py):
    the norm checked on the device and handed to the step (optim/optimizers.py skip_where: a
    fused step takes it as found_inf and gives each tensor's step count back where set, a
    per-tensor pass of its own on a CPU: the tiny preset's 0.8M parameters in 38 tensors
    stepped so in 2.8 ms where AdamW and clipping alone took 1.7, against an optimizer
    phase of 3.7 ms in its run at micro-batch 1); past `cap` parameters measured at `cap` and
    scaled (on a CPU the step is a pass over memory, linear in the parameters; a GPU's fixed
    cost per step is not, so calibrate_gpu measures two sizes whole)."""
    from torch.utils import _foreach_utils

    from scaletrain.optim.optimizers import skip_where

    scale = max(1.0, params / cap)
    n = max(1, int(params / scale))
    k = max(1, min(tensors, n))
    ps = [torch.nn.Parameter(torch.randn(n // k + (i < n % k), device=device)) for i in range(k)]
    for p in ps:
        p.grad = torch.randn_like(p)
    fused = torch.device(device).type in _foreach_utils._get_fused_kernels_supported_devices()
    opt = torch.optim.AdamW(ps, lr=1e-4, fused=fused or None)

    def step() -> None:
        norm = torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
        skip_where(opt, ~torch.isfinite(norm))

    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    return median_seconds(step, repeats=5, sync=sync) * scale


def host_op_seconds(
    replayed: Callable[[Any], float],
    tensor_parallel: bool = False,
    prepare: Callable[[Any], Callable[[], Any] | None] | None = None,
) -> float:
    """The host's cost per dispatched operation of an eager training pass beyond the
    operations' own calls: the tiny preset's block at 8 tokens forward and backward for
    real, less its replayed operations, over its dispatched count (module docstring). With
    `tensor_parallel`, the block split by the tensor-parallel plan over a mesh of one rank
    (DTensor's dispatch: the same traced operations cost the host more), in a gloo group of
    one made for it where none exists. With `prepare`, the operations and the pass measured
    in alternation (in_sequence), the median of the differences."""
    from scaletrain.config import load_config
    from scaletrain.models import model_spec

    spec = model_spec(load_config([], ["model.preset=tiny"]), 256)
    tokens = 8
    work = block_work(spec, 1, tokens, "fp32")
    dispatched = work.forward.dispatched + work.backward.dispatched
    run = _tp_block(spec, tokens, "cpu") if tensor_parallel else _plain_block(spec, tokens)
    if prepare is not None:
        pairs = _alternated(work, prepare, replayed, run)
        return statistics.median(max(0.0, real - ops) for ops, real in pairs) / dispatched
    ops = sum(replayed(c) * c.count for p in (work.forward, work.backward) for c in p.calls)
    real = median_seconds(run, repeats=31)
    return max(0.0, real - ops) / dispatched


def _plain_block(spec: Any, tokens: int, batch: int = 1) -> Callable[[], None]:
    block, extra = spec.traced_block(tokens)
    x = torch.randn(batch, tokens, spec.hidden_size, requires_grad=True)
    seed = torch.ones(batch, tokens, spec.hidden_size)

    def run() -> None:
        block(x.clone(), *extra).backward(seed)

    return run


def _tp_block(spec: Any, tokens: int, device_type: str, batch: int = 1, whole_group: bool = False) -> Callable[[], None]:
    """The block split by the tensor-parallel plan (sequence parallel, as runs split it) over
    a mesh of this rank alone, or with `whole_group` over every rank of the process group
    (calibrate.py: the gloo sweep's ranks), forward and backward of `batch` x `tokens`."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mkstemp()[1], 1)
        dist.init_process_group("gloo" if device_type == "cpu" else "nccl", store=store, rank=0, world_size=1)
    world = dist.get_world_size()
    if whole_group:
        mesh = DeviceMesh(device_type, list(range(world)))
    elif world == 1:
        mesh = DeviceMesh(device_type, [dist.get_rank()])
    else:  # a job's rank: its group spans others, so a mesh of one needs a group of its own
        mesh = DeviceMesh(device_type, [dist.get_rank()], _init_backend=False)
    model = spec.build_meta(tokens)
    spec.apply_tp(model, mesh, True, True)
    spec.materialize(model, torch.device(device_type), 0)
    block = next(iter(spec.blocks(model).children()))
    cos, sin = model.rope_cos[:tokens], model.rope_sin[:tokens]
    # The residual stream between blocks is each rank's local shard of the sequence (the
    # plan's layers return local tensors), as in the model.
    local = tokens // mesh.size()
    x = torch.randn(batch, local, spec.hidden_size, device=device_type, requires_grad=True)
    seed = torch.ones(batch, local, spec.hidden_size, device=device_type)

    def run() -> None:
        block(x.clone(), cos, sin).backward(seed)

    return run


def matmul_rate(n: int = 1024, device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    return 2 * n**3 / median_seconds(lambda: a @ b, sync=sync)


# in_sequence's and host_op_seconds' alternations. This machine's speed moves by ~10% within
# seconds: the small block's operations replayed back to back summed 48.8 to 63.4 ms between
# measurements a few seconds apart, its pass 58 to 74 ms (2026-12-01, AMD EPYC VM, 2 threads),
# so a ratio of one measurement of each, taken apart, moved with it and carried that into every
# prediction (the bench's predictions of one configuration 0.83-1.08 s where its runs measured
# 0.91-0.95). Six calibrations in a row there: one measurement of each, in_sequence 1.04-1.40
# and the host 3.1-8.3 us per operation; the median of 7 alternations, each pair within a
# second, 1.06-1.22 and 5.3-8.5 us (~5 s a thread count instead of ~2).
ALTERNATIONS = 7


def in_sequence(prepare: Callable[[Any], Callable[[], Any] | None], replayed: Callable[[Any], float], host_op: float) -> float:
    """How much slower a block's operations run one after another in a training pass than
    each replayed alone, its host's share taken out: the small preset's block at 4 x 256
    tokens forward and backward for real, less its dispatched operations' host cost, over
    the sum of its operations replayed (an operation alone finds its inputs in the caches
    its predecessor left and its output pages already mapped; in a pass it does not, and a
    pass meets the machine's usual interference). Measured in ALTERNATIONS alternations of
    the operations (each the median of 5 calls after one, as replay.seconds times a large
    one; `prepare(call)` gives the call with its arguments built, None where they cannot be
    built: then `replayed(call)`, its kept time) and the pass (the median of 5), the median
    of their ratios: both sides of each ratio see the machine in the same second."""
    from scaletrain.config import load_config
    from scaletrain.models import model_spec

    spec = model_spec(load_config([], ["model.preset=small"]), 4096)
    tokens, batch = 256, 4
    work = block_work(spec, batch, tokens, "fp32")
    dispatched = work.forward.dispatched + work.backward.dispatched
    pairs = _alternated(work, prepare, replayed, _plain_block(spec, tokens, batch))
    return statistics.median(max(0.5, (real - dispatched * host_op) / ops) if ops > 0 else 1.0 for ops, real in pairs)


def _alternated(
    work: Any, prepare: Callable[[Any], Callable[[], Any] | None], replayed: Callable[[Any], float], run: Callable[[], None]
) -> list[tuple[float, float]]:
    """ALTERNATIONS pairs (the pass's operations replayed one by one and summed, the pass
    itself), each pair measured within a second: an operation the median of 5 calls after
    one (as replay.seconds times a large one), or `replayed(call)`'s kept time where
    `prepare(call)` cannot build it; the pass the median of 5."""
    calls = [(c, prepare(c)) for p in (work.forward, work.backward) for c in p.calls]
    pairs = []
    for _ in range(ALTERNATIONS):
        ops = sum(c.count * (median_seconds(call, repeats=5) if call else replayed(c)) for c, call in calls)
        pairs.append((ops, median_seconds(run, repeats=5)))
    return pairs
