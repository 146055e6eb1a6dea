"""`scaletrain plan --calibrate`: this machine's rates for the planner's clock
(planning/clock/calibrate.py), kept where the clock reads them and said where."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

from scaletrain.cli.console import console
from scaletrain.config import Config
from scaletrain.models import PRESETS
from scaletrain.planning import planning_spec
from scaletrain.planning.clock.calibrate import calibrate_cpu, calibrate_gpu, save_calibration
from scaletrain.planning.clock.rates import save_table
from scaletrain.planning.hardware import gpu_kind
from scaletrain.strategies import TABLE

# The presets whose shapes a GPU's table always holds, beside the configured model's.
TABLE_PRESETS = ("1b", "8b", "70b")


def calibrate(cfg: Config) -> int:
    shown = console()

    def say(line: str) -> None:
        shown.print(f"calibrate: {line}", highlight=False, soft_wrap=True)

    if torch.cuda.is_available():
        from scaletrain.config import load_config

        models = [planning_spec(load_config([], [f"model.preset={p}"])) for p in TABLE_PRESETS if p in PRESETS]
        models.append(planning_spec(cfg))
        table = calibrate_gpu(models, say)
        kind = gpu_kind(table["device_name"])
        path = save_table(kind, table)
        say(
            f"the {kind} table ({table['device_name']}) written to {path}; commit it as src/scaletrain/planning/clock/tables/{kind}.json"
        )
        print(json.dumps({"kind": kind, "path": str(path)}))
        return 0
    values, lines = calibrate_cpu()
    for line in lines:
        say(line)
    values["engines"] = engine_overheads(say)
    path = save_calibration(values)
    say(f"kept in {path}" if path else "SCALETRAIN_CACHE=off: kept for this process only")
    return 0


# The probe: the tiny preset at 8 tokens in fp32 on one rank (its compute is ~1 ms), each
# engine's step against the plain one's at world 1 (the model and AdamW, no wrapper).
PROBE = ("model.preset=tiny", "data.seq_len=8", "train.micro_batch=1", "precision=fp32", "run.device=cpu")
PROBE_STEPS = 15


def engine_overheads(say: Any) -> dict[str, dict[str, float]]:
    """What each engine adds to a step beside the model's own work, on this CPU at one
    thread, on a model too small to compute: seconds per unit it wraps (FSDP: each block
    and the root; DeepSpeed: each parameter tensor, which its hooks visit and ZeRO-3
    gathers and releases), in forward with backward and
    in the optimizer's step (planning/clock/engines.py adds them per micro-batch and step)."""
    import os
    import socket

    from scaletrain.config import load_config
    from scaletrain.config.parallel import dims_for
    from scaletrain.engines import build_engine, preload
    from scaletrain.launch.distributed import init_distributed
    from scaletrain.models import model_spec
    from scaletrain.training.optim import decay_groups, lr_at

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
    world = init_distributed("cpu", "gloo", 120)
    times: dict[str, tuple[float, float]] = {}
    counts: dict[str, int] = {}
    # The plain engine (nothing partitioned: no wrapper at world 1) is the baseline.
    plain = next(r.name for r in TABLE.values() if r.partitions == 0)
    for strategy in TABLE:
        cfg = load_config([], [*PROBE, f"parallel.strategy={strategy}"])
        preload(cfg)
        spec = model_spec(cfg, 256)
        engine = build_engine(spec, world, dims_for(cfg.parallel, 1), cfg, decay_groups(cfg.train))
        tokens = torch.randint(0, 256, (1, 9))
        batch = [(tokens[:, :-1], tokens[:, 1:])]
        fb, st = [], []
        for i in range(PROBE_STEPS + 3):
            t0 = time.perf_counter()
            engine.forward_backward(batch, spec.loss)
            t1 = time.perf_counter()
            engine.step(lr_at(i, cfg.train))
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
        say(
            f"{strategy}: {out[strategy]['forward_backward_s'] * 1e6:.0f} us per unit ({n}) in forward and backward, "
            f"{out[strategy]['step_s'] * 1e6:.0f} us in the step, beyond {plain}'s"
        )
    return out
