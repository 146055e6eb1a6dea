"""Microbenchmarks behind the clock's rates (clock/rates.py): what `scaletrain plan
--calibrate` measures, and what the CPU's rates measure on first use.

- the host's cost per dispatched operation of an eager training pass (autograd and the
  module calls included): a small built-in block run forward and backward for real, less
  the time of its operations replayed alone, over the operations it dispatched;
- memory bandwidth: one large copy;
- AdamW's step (fused where torch has the kernel) with gradient clipping, at a given size;
- collectives over this machine's backend (gloo on a CPU, NCCL on GPUs) by size, in a pair
  of processes (or every local GPU);
- on a GPU: matmuls at the shapes the presets use, attention by length and head size,
  bandwidth by transfer size (the GPU's committed table, clock/tables/<kind>.json).

Every figure is a median of repeats. A machine busy with other work measures slow: the
calibration says so when other processes use its CPUs at its start or end (a CPU's:
clock/contention.py) or when the same matmul measured before and after differs by more
than `BUSY`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from scaletrain.planning.clock import contention, cpu_measured, rates
from scaletrain.planning.clock.float8_rates import float8_rows
from scaletrain.planning.clock.measure import (
    _plain_block,
    _tp_block,
    copy_bandwidth,
    host_op_seconds,
    matmul_rate,
    median_seconds,
    optimizer_seconds,
)
from scaletrain.planning.clock.trace import block_work, head_work, matmul_layout

BUSY = 0.15  # a matmul's rate moving more than this between the start and the end of a calibration


def busy(before: float, after: float, others: float | None = None) -> str:
    """A line when other processes used the CPU at the calibration's start or end
    (clock/contention.py: `others` cores) or the machine's matmul rate moved during it, else ''."""
    if others is not None:
        return (
            f"the machine is busy: other processes used {others:.1f} of its {contention.cores()} cores while it calibrated; "
            "the rates measured are kept but slow, calibrate again on a quiet machine"
        )
    if min(before, after) <= 0 or abs(after / before - 1) <= BUSY:
        return ""
    return (
        f"the machine looks busy: a matmul ran at {before / 1e9:.3g} GFLOP/s at the calibration's start and "
        f"{after / 1e9:.3g} at its end; the rates measured in between are kept, calibrate again on a quiet machine"
    )


# The collectives timed by size on this machine's backend: what the engines call (gloo has
# no reduce-scatter: FSDP2 and DeepSpeed all-reduce there instead, clock/rates.py).
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "send")
SIZES = [1 << k for k in range(14, 26, 2)]  # 16 KiB to 32 MiB: the full buffer of one call


def _collectives_rank(rank: int, world: int, store_path: str, out: dict[str, Any]) -> None:
    """A collective as a training step meets it: between two stretches of compute, each
    rank arriving when its own compute ends. On a CPU that costs more than the same call
    back to back (gloo's threads wake up on cores the compute keeps busy: a 1 MiB
    all-reduce took 1.4 ms back to back and 5.4 ms more than the compute alone when each
    followed 5 ms of matmuls, on this project's 2-core CPU), so each is timed as the
    difference between compute followed by the call and the compute alone."""
    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    table: dict[str, list[list[float]]] = {k: [] for k in COLLECTIVES}
    a, b = torch.randn(384, 384), torch.randn(384, 384)

    def compute() -> None:
        for _ in range(4):
            a @ b

    try:
        side = _in_step(dist, rank, world)
        tp = _tp_in_step(dist, world)
        # Two passes over every size and kind, each point the median of its passes' medians,
        # the compute alone timed again before each pass: this machine's speed drifts by
        # tens of percent over a minute (docs/planner.md).
        passes: dict[tuple[str, int], list[float]] = {}
        for _ in range(2):
            dist.barrier()
            alone = median_seconds(compute, repeats=15)
            for size in SIZES:
                calls = _calls(dist, rank, world, size)
                for kind in COLLECTIVES:
                    call = calls[kind]

                    def both() -> None:
                        compute()
                        call()  # noqa: B023 - called within this iteration

                    dist.barrier()
                    passes.setdefault((kind, size), []).append(max(0.0, median_seconds(both, repeats=11) - alone))
        for (kind, size), values in passes.items():
            table[kind].append([float(size), statistics.median(values)])
        if rank == 0:
            out.update(table)
            out[SIDE_BY_SIDE], out[TP_IN_STEP] = side, tp
    finally:
        dist.destroy_process_group()


SIDE_BY_SIDE = "side_by_side"
SIDE_ROUNDS = 5
SIDE_PASSES = 5


def _in_step(dist: Any, rank: int, world: int) -> float:
    """How much longer the ranks' compute takes in a synchronous run than one rank's alone:
    the clock replays each operation in one process, while a CPU run's ranks share the
    machine's caches, memory and, where two CPUs are one core's hardware threads, the core;
    and every collective waits for the slowest rank, so a stretch of compute between two of
    them lasts as long as the slowest rank's. On a shared virtual machine each CPU's speed
    drifts on its own by tens of percent from one second to the next (docs/planner.md), so
    the slowest of the ranks is slower than their mean. The compute: the small preset's block
    forward and backward at 4 x 256 tokens (the mix of matmuls and memory-bound work a step
    runs, ~60 ms here), each rank timed alone while the others wait at a barrier, then every
    rank's passes in step, each pass starting at a barrier and lasting as long as its slowest
    rank's (a barrier's own time is not in it: the collectives' rows have theirs)."""
    from scaletrain.config import load_config
    from scaletrain.models import model_spec

    block = _plain_block(model_spec(load_config([], ["model.preset=small"]), 256), 256, batch=4)
    block()  # the first pass allocates
    # Alone and in step in turn, SIDE_ROUNDS times, the median of the rounds' ratios: what a
    # synchronous run meets as a rule, not one moment of the machine's.
    ratios = []
    for _ in range(SIDE_ROUNDS):
        alone = torch.zeros(1)
        for r in range(world):
            dist.barrier()
            if r == rank:
                alone[0] = median_seconds(block, repeats=5)
        dist.all_reduce(alone)  # the ranks' alone times, summed
        ratios.append(_paced(dist, block) / (alone.item() / world))
    # In step the ranks never compute faster than alone: a median below 1 is drift.
    return max(1.0, statistics.median(ratios))


def _paced(dist: Any, run: Callable[[], None]) -> float:
    """The median of SIDE_PASSES passes of `run` on every rank, each starting at a barrier and
    lasting as long as its slowest rank's (an all-reduce with MAX)."""
    paced = torch.zeros(SIDE_PASSES)
    for i in range(SIDE_PASSES):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        paced[i] = time.perf_counter() - t0
    dist.all_reduce(paced, op=dist.ReduceOp.MAX)
    return statistics.median(paced.tolist())


TP_IN_STEP = "tp_block_in_step"
TP_BLOCK = (4, 256)  # micro-batch x tokens of the small preset's block that _tp_in_step splits


def _tp_in_step(dist: Any, world: int) -> float:
    """Seconds of the small preset's block split by the tensor-parallel plan over all `world`
    ranks (sequence parallel, as a run splits it), forward and backward of TP_BLOCK, the ranks
    in step: the median of SIDE_ROUNDS rounds of _paced passes. Its collectives run for real,
    and DTensor's bookkeeping with them (host_op_tp_in_step)."""
    from scaletrain.config import load_config
    from scaletrain.models import model_spec

    batch, tokens = TP_BLOCK
    run = _tp_block(model_spec(load_config([], ["model.preset=small"]), tokens), tokens, "cpu", batch, whole_group=True)
    run()  # the first pass allocates
    return statistics.median(_paced(dist, run) for _ in range(SIDE_ROUNDS))


def host_op_tp_in_step(passed: float, links: dict[str, Any], side: float, world: int) -> float:
    """DTensor's cost per dispatched operation on `world` ranks in step (tensor parallel as a
    CPU run meets it): _tp_in_step's pass less what the clock prices apart from it, over the
    operations the rank's block dispatches. Apart: the block's operations as a several-rank run's
    (replayed at one thread, in sequence, x `side`) and its eight collectives (with sequence
    parallel an all-gather before each sub-block and a reduce-scatter after it, forward and
    backward) at `links`, the rows just measured. What is left is the host's: DTensor's
    dispatch and redistribution on a real mesh (each operation's sharding propagated, each
    collective's result wrapped and waited for), and whatever the collectives cost in the pass
    beyond their rows, so the split between the two terms moves with the rows while their sum
    is the pass (docs/planner.md). Not below 0: a pass faster than its parts is drift."""
    from scaletrain.config import load_config
    from scaletrain.models import model_spec
    from scaletrain.planning.clock.compute import price, tp_rank_model

    batch, tokens = TP_BLOCK
    spec = model_spec(load_config([], ["model.preset=small"]), tokens)
    work = block_work(tp_rank_model(spec, world) or spec, batch, tokens, "fp32")
    r = rates.several_cpu_ranks(links, side)
    ops = sum(price(p, r, False, host_op=0.0).seconds for p in (work.forward, work.backward))
    buffer = batch * tokens * spec.hidden_size * 4
    collectives = 4 * (r.collective("all_gather", buffer, world, 0) + r.collective("reduce_scatter", buffer, world, 0))
    return max(0.0, passed - ops - collectives) / (work.forward.dispatched + work.backward.dispatched)


def _calls(dist: Any, rank: int, world: int, size: int, device: str = "cpu") -> dict[str, Callable[[], Any]]:
    """Each collective of COLLECTIVES (and NCCL's reduce-scatter) on a full buffer of `size` bytes."""
    full = torch.zeros(size // 4, device=device)
    part = torch.zeros(size // 4 // world, device=device)
    # The all-to-all's input: a GPU's made once; a CPU's copied in each call, as gloo's rows have
    # always been measured (the copy part of what a CPU rank's call costs; clock tables kept as measured).
    other = full.clone() if device != "cpu" else None
    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, part),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
        "all_to_all": lambda: dist.all_to_all_single(full, other if other is not None else full.clone()),
        "send": lambda: _exchange(dist, rank, full),
    }


def _exchange(dist: Any, rank: int, t: torch.Tensor) -> None:
    """One pipeline hop: rank 0 sends, rank 1 receives (the others idle)."""
    if rank == 0:
        dist.send(t, 1)
    elif rank == 1:
        dist.recv(t, 0)


def gloo_collectives(world: int = 2) -> tuple[dict[str, dict[str, Any]], float, float]:
    """Each collective's seconds by the bytes of its full buffer, over `world` gloo
    processes on this machine (one thread each, as a CPU run's ranks): see `monotone`; how
    much longer the ranks compute in step than one alone (`_in_step`); and the seconds of a
    tensor-parallel block over them in step (`_tp_in_step`)."""
    found = _gloo_sweep(world)
    side, tp = float(found.pop(SIDE_BY_SIDE)), float(found.pop(TP_IN_STEP))
    return {kind: {"ranks": world, "rows": monotone(rows)} for kind, rows in found.items()}, side, tp


def monotone(rows: list[list[float]]) -> list[list[float]]:
    """A sweep of [bytes, seconds] made non-decreasing in time: each point the least time of
    itself and every larger size's (a single point of a sweep on a shared CPU jitters by
    2-4x; a larger buffer never takes less time)."""
    out: list[list[float]] = []
    best = float("inf")
    for size, t in sorted(rows, reverse=True):
        best = min(best, t)
        out.append([size, best])
    return sorted(out)


def _gloo_sweep(world: int) -> dict[str, Any]:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.get_context("spawn").Manager()
        out = manager.dict()
        mp.start_processes(_spawned, args=(world, os.path.join(tmp, "store"), out), nprocs=world, start_method="spawn")
        return dict(out)


def _spawned(rank: int, world: int, store: str, out: Any) -> None:
    torch.set_num_threads(1)
    _collectives_rank(rank, world, store, out)


# -- the GPUs' collectives (a table's "collectives", clock/rates.py) ----------------------------
GPU_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
GPU_SIZES = [1 << k for k in range(20, 31, 2)]  # 1 MiB to 1 GiB: a block's gather of the presets and more


def device_collectives(
    world: int, backend: str = "nccl", sizes: list[int] | None = None, kinds: tuple[str, ...] = GPU_COLLECTIVES
) -> dict[str, dict[str, Any]]:
    """Each collective's seconds by the bytes of its full buffer over `world` processes, one
    per local GPU (NCCL over NVLink: the rows a table keeps as "intra"), timed as nccl-tests
    times them, back to back between syncs: on a GPU a collective runs on its own stream beside
    the compute, and what of it the compute hides is the clock's to price (clock/engines.py).
    `backend` gloo times the same sweep between CPU processes (the path's test)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.get_context("spawn").Manager()
        out = manager.dict()
        args = (world, os.path.join(tmp, "store"), out, backend, sizes or GPU_SIZES, kinds)
        mp.start_processes(_device_rank, args=args, nprocs=world, start_method="spawn")
        return {kind: {"ranks": world, "rows": monotone(rows)} for kind, rows in dict(out).items()}


def _device_rank(
    rank: int, world: int, store_path: str, out: Any, backend: str, sizes: list[int], kinds: tuple[str, ...]
) -> None:
    import torch.distributed as dist

    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    sync: Callable[[], None] = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    table: dict[str, list[list[float]]] = {k: [] for k in kinds}
    try:
        for size in sizes:
            calls = _calls(dist, rank, world, size, device)
            for kind in kinds:
                dist.barrier()
                table[kind].append([float(size), median_seconds(calls[kind], repeats=5, sync=sync)])
        if rank == 0:
            out.update(table)
    finally:
        dist.destroy_process_group()


def calibrate_cpu(world: int = 2) -> tuple[dict[str, Any], list[str]]:
    """This machine's CPU: the host's cost per operation and the copy bandwidth at each
    thread count a run uses (all cores for one process, one for each of several), and gloo's
    collectives between `world` processes; with the lines to print."""
    others = contention.busy(torch.get_num_threads())
    before = matmul_rate()
    values: dict[str, Any] = {}
    lines = []
    for threads in sorted({torch.get_num_threads(), 1}):
        replayed = lambda c: cpu_measured.replayed_seconds(c, threads)  # noqa: B023, E731 - used within this iteration
        with cpu_measured.Threads(threads):
            host, bw = host_op_seconds(replayed, prepare=cpu_measured.prepared_call), copy_bandwidth()
            host_tp = (
                host_op_seconds(replayed, tensor_parallel=True, prepare=cpu_measured.prepared_call) if threads == 1 else None
            )
        values[f"host_op_{threads}"], values[f"bandwidth_{threads}"] = host, bw
        line = f"{threads} thread{'s' * (threads > 1)}: {host * 1e6:.1f} us per operation, copies at {bw / 1e9:.1f} GB/s"
        if host_tp is not None:
            values[f"host_op_tp_{threads}"] = host_tp
            line += f"; under tensor parallel (DTensor) {host_tp * 1e6:.1f} us per operation"
        lines.append(line)
    values["collectives"], values[SIDE_BY_SIDE], tp = gloo_collectives(world)
    lines.append(f"{world} ranks in step: their compute takes {values[SIDE_BY_SIDE]:.2f}x as long as one alone")
    values["host_op_tp_in_step"] = host_op_tp_in_step(tp, values["collectives"], values[SIDE_BY_SIDE], world)
    lines.append(
        f"tensor parallel over {world} ranks in step: {values['host_op_tp_in_step'] * 1e6:.1f} us per operation "
        f"(the small block's pass {tp * 1e3:.1f} ms, its operations and collectives taken out)"
    )
    for kind, entry in values["collectives"].items():
        rows = entry["rows"]
        lines.append(
            f"gloo {kind.replace('_', '-')} ({world} processes): {rows[0][1] * 1e3:.2f} ms at {rows[0][0] / 1024:.0f} KiB, "
            f"{rows[-1][1] * 1e3:.1f} ms at {rows[-1][0] / 2**20:.0f} MiB"
        )
    after = matmul_rate()
    warning = busy(before, after, others if others is not None else contention.busy(torch.get_num_threads()))
    return values, [*lines, *([warning] if warning else [])]


def save_calibration(values: dict[str, Any]) -> Any:
    """Keep `values` as this machine's calibration (clock/rates.py reads it); the path, or None
    where the cache is off (the values then hold for this process only)."""
    import json

    from scaletrain import disk_cache

    rates.set_calibration(values)
    path = disk_cache.cache_path(rates.CALIBRATION_FILE)
    key = cpu_measured.cpu_key("calibration")
    if path is None or key is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "measured": time.strftime("%Y-%m-%d"), "values": values}))
    tmp.replace(path)
    return path


# -- a GPU's table (clock/tables/<kind>.json) --------------------------------------------------
# Up to 128k tokens: a long-sequence plan (the 1b preset at 193,536 tokens) prices its attention at
# the rate of the longest length measured (clock/rates.py), 8 heads there (~3e13 FLOPs, ~0.1 s a call).
ATTENTION_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
ATTENTION_HEADS_DIMS = (64, 128)
BANDWIDTH_SIZES = [1 << k for k in range(20, 31, 2)]  # 1 MiB to 1 GiB


def matmul_shapes(models: list[Any], tokens: tuple[int, ...] = (2048, 16384)) -> list[tuple[int, int, int, str]]:
    """The (M, N, K, operand layout) of every matmul the models' blocks and heads run forward
    and backward, at each of `tokens` tokens per micro-batch: the shapes a plan of them prices
    (trace.matmul_layout: nn.Linear's forward "nt", its weight gradient "tn", its input's "nn")."""
    shapes: set[tuple[int, int, int, str]] = set()
    for model in models:
        for n in tokens:
            for work in (block_work(model, 1, n, "pure16"), head_work(model, 1, n, "pure16")):
                for p in (work.forward, work.backward):
                    shapes.update(
                        (c.shape[1], c.shape[2], c.shape[3], matmul_layout(c.op, c.args))
                        for c in p.of("matmul")
                        if len(c.shape) == 4
                    )
    return sorted(shapes)


def _operand(rows: int, cols: int, layout: str, device: str, dtype: torch.dtype) -> torch.Tensor:
    """A [rows, cols] operand, row-major ("n") or a transposed view of a [cols, rows] one ("t")."""
    if layout == "n":
        return torch.randn(rows, cols, device=device, dtype=dtype)
    return torch.randn(cols, rows, device=device, dtype=dtype).t()


def attention_heads(length: int) -> int:
    """Heads of one attention call in the calibration: about 2^31 x head size causal FLOPs at
    length up to 16384 (512 heads at 2048 tokens), 8 heads beyond."""
    return max(8, (1 << 31) // (length * length))


# A matmul shorter than this is timed in a burst of calls between two syncs (below).
BURST_SECONDS = 2e-3
# The micro-batch tokens whose shapes the table holds in fp32 (bf16: calibrate_gpu's default, both).
FLOAT32_TOKENS = (2048,)


def gemm_seconds(call: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Seconds of one matmul as a step runs it: back to back. A call shorter than
    BURST_SECONDS is timed in a burst of as many calls as fill it (one call between syncs
    measured 615 TFLOP/s at the 1b preset's largest shapes where its profiled step ran its
    matmuls at ~730: the first table); a longer one is its own burst, its first timing kept
    (timed again in a burst of one: six calls more, some 30 of the h200 table's 111 s as its
    rates price them)."""
    once = median_seconds(call, repeats=3, sync=sync)
    burst = min(20, int(BURST_SECONDS / max(once, 1e-6)))
    if burst <= 1:
        return once
    return median_seconds(lambda: [call() for _ in range(burst)], repeats=5, sync=sync) / burst


def warm_up(device: str, seconds: float = 1.0) -> None:
    """Matmuls back to back for `seconds`: a GPU idle until now runs its first ones at lower
    clocks (a lent H200 measured 533 TFLOP/s at its calibration's start and 675 at its end, and
    the calibration called itself busy), so that the sweep and the busy check that brackets it
    measure the clocks a training step runs at."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def calibrate_gpu(models: list[Any], say: Callable[[str], None]) -> dict[str, Any]:
    """This GPU's table: matmuls at the models' shapes (bf16, fp32 and train.float8's), FlashAttention by
    length and head size through SDPA, copy bandwidth by size, the host's cost per operation
    (plain and under tensor parallel over a mesh of one), the shortest kernel, AdamW's
    bytes per second; within about a minute."""
    import datetime

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    device = "cuda"
    sync = torch.cuda.synchronize
    started = time.perf_counter()
    warm_up(device)
    before = matmul_rate(4096, device, torch.bfloat16)
    table: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "measured": datetime.date.today().isoformat(),
        "matmul": {},
        "attention": {"forward": [], "backward": []},
    }
    shapes = matmul_shapes(models)

    def rate(m: int, n: int, k: int, layout: str, dtype: torch.dtype) -> float:
        a, b = _operand(m, k, layout[0], device, dtype), _operand(k, n, layout[1], device, dtype)
        return 2.0 * m * n * k / gemm_seconds(lambda: a @ b, sync)

    # Every shape row-major ("nn", the rows any layout falls back to), in bf16 and fp32; in bf16, what
    # training computes in, each other layout a pass runs it in too: nn.Linear's forward multiplies
    # by a transposed weight and its weight gradient by a transposed activation, and cuBLAS runs the
    # same shape at another rate in each.
    plain = sorted({s[:3] for s in shapes})
    table["matmul"]["bfloat16"] = [[m, n, k, rate(m, n, k, "nn", torch.bfloat16)] for m, n, k in plain]
    # fp32 at the shorter micro-batch's shapes only: the longer's are 8x the work at the same
    # (compute-bound) rate, some 45 of the h200 table's 111 s as its rates price them; a call between the
    # shapes measured is priced at the nearest one's rate (clock/rates.py).
    plain32 = sorted({s[:3] for s in matmul_shapes(models, FLOAT32_TOKENS)})
    table["matmul"]["float32"] = [[m, n, k, rate(m, n, k, "nn", torch.float32)] for m, n, k in plain32]
    by_layout: dict[str, list[list[float]]] = {}
    for m, n, k, layout in shapes:
        if layout != "nn":
            by_layout.setdefault(layout, []).append([m, n, k, rate(m, n, k, layout, torch.bfloat16)])
    table["matmul_layout"] = {"bfloat16": by_layout}
    # train.float8's products (torch._scaled_mm) at the calls the models' float8 blocks make.
    float8 = float8_rows(models, device, lambda call: gemm_seconds(call, sync))
    table["matmul"].update(float8)
    say(
        f"matmuls: {len(plain)} shapes in bf16, {len(plain32)} in fp32, {sum(map(len, by_layout.values()))} in bf16 in the layouts "
        f"the passes run them in, {sum(map(len, float8.values()))} float8 ({time.perf_counter() - started:.0f} s in)"
    )
    # FlashAttention (torch's choice) and cuDNN's fused attention, which train.attention_kernel=auto
    # takes where it is faster (training/attention_kernel.py): the clock prices the faster.
    table["attention"]["cudnn"] = {"forward": [], "backward": []}
    for kernel, rows in (
        (SDPBackend.FLASH_ATTENTION, table["attention"]),
        (SDPBackend.CUDNN_ATTENTION, table["attention"]["cudnn"]),
    ):
        for d in ATTENTION_HEADS_DIMS:
            for t in ATTENTION_LENGTHS:
                # As many heads as a training micro-batch gives the kernel (16 x 32 at 2048 tokens): the
                # first table (2026-11-29) used 2^16 / t, a few GFLOPs at short lengths, launch-bound.
                heads = attention_heads(t)
                # Laid out as the models hand them to SDPA: the heads a transposed view of [batch,
                # sequence, heads, head size] (the layout decides which kernels take a call, and how fast).
                q, key, v = (
                    torch.randn(1, t, heads, d, device=device, dtype=torch.bfloat16, requires_grad=True).transpose(1, 2)
                    for _ in range(3)
                )
                flops = 2 * 2.0 * heads * t * (t + 1) / 2 * d  # the causal kernel's two products

                def forward() -> torch.Tensor:
                    with sdpa_kernel([kernel]):  # noqa: B023 - called within this iteration
                        return scaled_dot_product_attention(q, key, v, is_causal=True)  # noqa: B023

                try:
                    out, seed = forward(), torch.ones_like(q)
                    fwd = median_seconds(forward, repeats=5, sync=sync)
                    bwd = median_seconds(lambda: out.backward(seed, retain_graph=True), repeats=5, sync=sync)  # noqa: B023
                except RuntimeError:  # no such kernel for this shape (cuDNN's: a head size, a build without it)
                    continue
                rows["forward"].append([t, d, flops / fwd])
                rows["backward"].append([t, d, 2.5 * flops / bwd])
    table["attention"]["heads"] = "2^31 / length^2, at least 8"
    say(
        f"attention: SDPA by length and head size (FlashAttention; cuDNN at {len(table['attention']['cudnn']['forward'])} shapes; "
        f"{time.perf_counter() - started:.0f} s in)"
    )
    rows = []
    for size in BANDWIDTH_SIZES:
        src = torch.empty(size // 2, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        rows.append([2 * size, 2 * size / median_seconds(lambda: dst.copy_(src), sync=sync)])  # noqa: B023
    table["bandwidth"] = rows
    table["memory_bytes_per_s"] = rows[-1][1]
    tiny = torch.empty(1, device=device)
    table["launch_s"] = median_seconds(lambda: [tiny.add_(1) for _ in range(100)], sync=sync) / 100
    # Two sizes, whole: the bytes' rate from their difference, the rest a fixed cost per step (the
    # first table scaled one 32M-parameter step up linearly, its fixed cost with it: 1.05e12 B/s
    # where the 1b preset's profiled AdamW moved ~3.8e12).
    small, large = 64 << 20, 256 << 20
    t_small, t_large = (optimizer_seconds(n, 64, device, cap=n) for n in (small, large))
    table["optimizer_bytes_per_s"] = 40.0 * (large - small) / max(t_large - t_small, 1e-9)
    table["optimizer_fixed_s"] = max(0.0, t_small - 40.0 * small / table["optimizer_bytes_per_s"])
    table["host_op_s"], table["host_op_tp_s"] = _cuda_host_op(False), _cuda_host_op(True)
    say(
        f"host: {table['host_op_s'] * 1e6:.1f} us per operation ({table['host_op_tp_s'] * 1e6:.1f} under tensor parallel; "
        f"{time.perf_counter() - started:.0f} s in)"
    )
    after = matmul_rate(4096, device, torch.bfloat16)
    warning = busy(before, after)
    if warning:
        say(warning)
    return table


def _cuda_host_op(tensor_parallel: bool) -> float:
    """The host's cost per dispatched operation of a training pass on the GPU: the tiny
    preset's block at 8 tokens, whose kernels take less than their launch, forward and
    backward, over its dispatched count (the host's whole share: a GPU's kernels run beside it)."""
    from scaletrain.config import load_config
    from scaletrain.models import model_spec

    spec = model_spec(load_config([], ["model.preset=tiny"]), 256)
    work = block_work(spec, 1, 8, "fp32")
    # Not under a CUDA default device for tensor parallel: its weights are drawn on the host from
    # per-name CPU generators (as every run's are), then copied; the block's inputs name their device.
    if tensor_parallel:
        run = _tp_block(spec, 8, "cuda")
    else:
        with torch.device("cuda"):
            run = _plain_block(spec, 8)
    real = median_seconds(run, repeats=31, sync=torch.cuda.synchronize)
    return real / (work.forward.dispatched + work.backward.dispatched)
