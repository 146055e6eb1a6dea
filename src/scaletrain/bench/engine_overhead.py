"""What each engine adds to a step beside the model's own work, measured on a model too
small to compute, on this CPU or (a GPU's `--calibrate`) on the GPU: `scaletrain plan
--calibrate` keeps it for the planner's clock (planning/clock/engines.py prices it per unit
each engine wraps). On a GPU the probe's kernels are microseconds, so what it times is the
host's work: the engines' hooks, bookkeeping and launches, which a small model's step waits
on (the `small` engine checks of docs/gpu/: fsdp 53 ms and zero3 166 ms where the plain
engine took 36)."""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

import torch

from scaletrain.strategies import TABLE

# The probe: the tiny preset at 8 tokens on one rank (its compute is ~1 ms on a CPU core), each
# engine's step against the plain one's at world 1 (the model and AdamW, no wrapper): in fp32
# on a CPU, in bf16 on a GPU (what its runs train in).
PROBE_STEPS = 15
TORCH_ADAM = "parallel.deepspeed_extra={optimizer: {params: {torch_adam: true}}}"


def probe(device: str = "cpu") -> tuple[str, ...]:
    precision = "bf16" if device == "cuda" else "fp32"
    return ("model.preset=tiny", "data.seq_len=8", "train.micro_batch=1", f"precision={precision}", f"run.device={device}")


def engine_overheads(say: Any, device: str = "cpu") -> dict[str, dict[str, float]]:
    """`measured(device)` in a process of its own (it makes process groups and sets the
    launcher's variables, which the caller's later runs must not inherit), with a line per
    engine."""
    import json
    import subprocess
    import sys

    code = f"import json; from scaletrain.bench.engine_overhead import measured; print(json.dumps(measured({device!r})))"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if proc.returncode:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        say(f"the engines' own cost was not measured ({lines[-1] if lines else 'no output'}): the clock leaves it out")
        return {}
    out: dict[str, dict[str, float]] = json.loads(proc.stdout.strip().splitlines()[-1])
    for strategy, per in out.items():
        say(
            f"{strategy}: {per['forward_backward_s'] * 1e6:.0f} us per unit ({per['per']:.0f}) in forward and backward, "
            f"{per['step_s'] * 1e6:.0f} us in the step, beyond the plain engine's"
        )
    return out


def measured(device: str = "cpu") -> dict[str, dict[str, float]]:
    """What each engine adds to a step beside the model's own work, on `device` (a CPU at
    one thread), on a model too small to compute: seconds per unit it wraps (FSDP: each
    block and the root; DeepSpeed: each parameter tensor, which its hooks visit and ZeRO-3
    gathers and releases), in forward with backward and in the optimizer's step
    (planning/clock/engines.py adds them per micro-batch and step). A GPU's queue is waited
    on after each part, so that what the host queued ahead counts where it ran."""

    from scaletrain.config import load_config
    from scaletrain.config.parallel import dims_for
    from scaletrain.engines import build_engine, preload
    from scaletrain.launch.distributed import init_distributed
    from scaletrain.models import model_spec
    from scaletrain.optim.optimizers import decay_groups
    from scaletrain.optim.schedule import lr_at

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if not cuda:
        torch.set_num_threads(1)
    # One rank as a launcher would describe it (DeepSpeed asks for LOCAL_RANK; FSDP's group
    # of one for an address): a free port on this machine.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {
        "LOCAL_RANK": "0",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        os.environ.setdefault(key, value)
    world = init_distributed(device, "nccl" if cuda else "gloo", 120)
    times: dict[str, tuple[float, float]] = {}
    counts: dict[str, int] = {}
    # The plain engine (nothing partitioned: no wrapper at world 1) is the baseline.
    plain = next(r.name for r in TABLE.values() if r.partitions == 0)
    for strategy in TABLE:
        # On a GPU, DeepSpeed's own FusedAdam would be JIT-built with nvcc first (about a minute
        # on a fresh machine, longer than the rest of --calibrate): torch's AdamW inside
        # DeepSpeed instead. What the probe times is the engine's bookkeeping around the
        # optimizer (the clock prices the optimizer's own pass from its bytes), and that is the
        # same around either.
        extra = [TORCH_ADAM] if cuda and TABLE[strategy].deepspeed_json else []  # the engines that take DeepSpeed's JSON
        cfg = load_config([], [*probe(device), f"parallel.strategy={strategy}", *extra])
        preload(cfg)
        spec = model_spec(cfg, 256)
        engine = build_engine(spec, world, dims_for(cfg.parallel, 1), cfg, decay_groups(cfg.train))
        tokens = torch.randint(0, 256, (1, 9))
        batch = [(tokens[:, :-1], tokens[:, 1:])]
        fb, st = [], []
        for i in range(PROBE_STEPS + 3):
            sync()
            t0 = time.perf_counter()
            engine.forward_backward(batch, spec.loss)
            sync()
            t1 = time.perf_counter()
            engine.step(lr_at(i, cfg.train))
            sync()
            t2 = time.perf_counter()
            if i >= 3:
                fb.append(t1 - t0)
                st.append(t2 - t1)
        times[strategy] = (statistics.median(fb), statistics.median(st))
        meta = spec.build_meta(8)
        counts[strategy] = spec.n_blocks + 1 if TABLE[strategy].buffers == "fsdp_units" else sum(1 for _ in meta.parameters())
        del engine
    base = times[plain]
    out = {}
    for strategy, (passes, step) in times.items():
        if strategy == plain:
            continue
        n = counts[strategy]
        out[strategy] = {"per": n, "forward_backward_s": max(0.0, passes - base[0]) / n, "step_s": max(0.0, step - base[1]) / n}
    # The plain engine wraps the model in DDP where there are several ranks only: its
    # reducer's hooks (one per parameter, marking it ready and copying it into its bucket)
    # timed on a group of one, against the bare model's pass.
    out[plain] = {"per": counts[plain], "forward_backward_s": _ddp_wrapper(device) / counts[plain], "step_s": 0.0}
    return out


def _ddp_wrapper(device: str) -> float:
    """Seconds DistributedDataParallel adds to the probe's forward and backward on a group of one."""
    import tempfile

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from scaletrain.config import load_config
    from scaletrain.models import model_spec

    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.FileStore(tempfile.mkstemp()[1], 1), rank=0, world_size=1)
    spec = model_spec(load_config([], list(probe(device))), 256)
    model = spec.build_meta(8)
    spec.materialize(model, torch.device(device), 0)
    wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)
    tokens = torch.randint(0, 256, (1, 9), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def one(m: torch.nn.Module) -> float:
        times = []
        for i in range(PROBE_STEPS + 3):
            sync()
            t0 = time.perf_counter()
            spec.loss(m(tokens[:, :-1]), tokens[:, 1:]).backward()
            sync()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return max(0.0, one(wrapped) - one(model))
