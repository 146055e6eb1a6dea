"""`scaletrain plan --calibrate`: this machine's rates for the planner's clock
(planning/clock/calibrate.py), kept where the clock reads them and said where."""

from __future__ import annotations

import json
import time

import torch

from scaletrain.bench.engine_overhead import engine_overheads
from scaletrain.cli.console import console
from scaletrain.config import Config
from scaletrain.models import PRESETS
from scaletrain.planning import planning_spec
from scaletrain.planning.clock.calibrate import GPU_SIZES, calibrate_cpu, calibrate_gpu, device_collectives, save_calibration
from scaletrain.planning.clock.rates import save_table
from scaletrain.planning.hardware import gpu_kind

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
        # The collectives by size over this node's GPUs (NVLink); one GPU has nothing to time, and
        # the clock keeps the datasheet's link rates (and, across nodes, always: rates.py).
        gpus = torch.cuda.device_count()
        if gpus > 1:
            started = time.perf_counter()
            table["collectives"] = {"intra": device_collectives(gpus)}
            say(f"collectives: NCCL over the {gpus} GPUs, {len(GPU_SIZES)} sizes each ({time.perf_counter() - started:.0f} s)")
        else:
            say("collectives: one GPU here, none to time: plans of several price the datasheet's NVLink and network")
        # Each engine's own host work on this GPU (its hooks; a small model's step waits on them).
        started = time.perf_counter()
        table["engines"] = engine_overheads(say, "cuda")
        say(f"engines: {time.perf_counter() - started:.0f} s")
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
