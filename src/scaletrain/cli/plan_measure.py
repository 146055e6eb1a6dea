"""`scaletrain plan --measure`: the configured strategy's predicted peak memory against the
one measured over 2 real steps of its engine, at this process world (plan.py checks first
what it cannot measure)."""

from __future__ import annotations

import gc
import json
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY as _TOTAL
from torch.distributed._tools.mem_tracker import MemTracker

from scaletrain.cli.console import console
from scaletrain.config import Config
from scaletrain.config.batch import settle
from scaletrain.config.parallel import dims_for
from scaletrain.engines import build_engine
from scaletrain.launch.distributed import init_distributed, shutdown
from scaletrain.models import ModelSpec
from scaletrain.optim.optimizers import decay_groups
from scaletrain.optim.schedule import lr_at
from scaletrain.planning import planning_spec
from scaletrain.planning.hardware import gpu, this_cpu
from scaletrain.planning.planner import evaluate, setups_for
from scaletrain.planning.report import print_measurement

# MemTracker's categories, folded into the planner's components.
_COMPONENTS = {
    "PARAM": "params",
    "GRAD": "grads",
    "OPT": "optimizer",
    "ACT": "activations+loss",
    "TEMP": "activations+loss",
    "BUFFER": "buffers",
    "OTH": "buffers",
}


class _PeakTracker(MemTracker):
    """torch's MemTracker without its per-module peaks, which `--measure` never reads.

    After every operator MemTracker compares the current total with the peak of each module
    it has seen (its `_update_peak_stats`: a walk over a weak dictionary of every module, for
    every operator): on this CPU that walk was 40% of the measured steps' time (cProfile,
    the small preset with tiles). The categories (params, grads, optimizer, activations)
    come from where each tensor is made, not from this walk, so they stay as they are; the
    process-wide peak and its snapshot are what `get_tracker_snapshot("peak")` returns.
    """

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            total = dev_snap[_TOTAL]
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(dev_snap)


def measure(cfg: Config, as_json: bool) -> int:
    """Plan the configured strategy for this process world, then measure it for real."""
    shown = console()
    world = init_distributed(cfg.run.device, cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        model = planning_spec(cfg)
        device = (
            this_cpu()
            if world.device.type == "cpu"
            else gpu(None, f"{torch.cuda.get_device_properties(world.device).total_memory}B")
        )
        cfg = settle(cfg, dims_for(cfg.parallel, world.world_size).dp_size)  # grad_accum from train.global_batch
        setup = setups_for(cfg, world.world_size, 1, False)[0]
        # Memory only: untimed, the clock's CPU replays (seconds per new shape) are not run.
        predicted = evaluate(model, setup, cfg, device, 1, device.memory, None, timed=False).memory.as_dict()
        measured = measure_peak(cfg, world, model)
        if world.is_main:
            if as_json:
                print(
                    json.dumps({"strategy": setup.label, "world": world.world_size, "predicted": predicted, "measured": measured})
                )
            else:
                shown.print(f"[bold]{setup.label}[/] at world {world.world_size} on {world.device.type}", highlight=False)
                print_measurement(shown, predicted, measured)
    finally:
        gc.collect()
        shutdown(world)
    return 0


def measure_peak(cfg: Config, world: Any, model: ModelSpec, steps: int = 2) -> dict[str, float]:
    """Bytes at this rank's peak, by component, plus 'peak' (and 'cuda_max_allocated' on GPU).

    Two steps: the optimizer's state appears in the first one's step, so the second runs
    forward and backward beside everything a step holds, and a third only repeats it (on this
    CPU the same peak to the byte over 3 and 2 steps for ddp, fsdp with tiles, fsdp with
    activation checkpointing at world 2, zero2 and zero3 bf16 at world 2; 2026-11-29).

    Every allocation from before the model is built to the end of the last step is tracked
    by torch's MemTracker (a dispatch-mode tensor tracker that also sorts tensors into
    params, grads, optimizer state, activations and temporaries), so buffers DeepSpeed or
    FSDP allocate at set-up count too. Tokens are random: memory does not depend on them.
    """
    if world.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(world.device)
    tracker = _PeakTracker()
    generator = torch.Generator().manual_seed(cfg.train.seed)
    dims = dims_for(cfg.parallel, world.world_size)
    with tracker:
        engine = build_engine(model, world, dims, cfg, decay_groups(cfg.train))
        for step in range(steps):
            tracker.reset_mod_stats()  # MemTracker tracks one iteration's module stats at a time
            batches = [_random_batch(cfg, model, generator) for _ in range(cfg.train.grad_accum)]
            engine.forward_backward(batches, model.loss)  # the trainer's own unit of work
            engine.step(lr_at(step, cfg.train))
        del engine
    snapshot = tracker.get_tracker_snapshot("peak")
    out: dict[str, float] = {}
    for device, by_kind in snapshot.items():
        if torch.device(device).type != world.device.type:
            continue
        for kind, nbytes in by_kind.items():
            name = str(kind).split(".")[-1]
            if name == "Total":
                out["peak"] = float(nbytes)
            else:
                key = _COMPONENTS.get(name, "buffers")
                out[key] = out.get(key, 0.0) + float(nbytes)
    if world.device.type == "cuda":
        out["cuda_max_allocated"] = float(torch.cuda.max_memory_allocated(world.device))
    return out


def _random_batch(cfg: Config, model: ModelSpec, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, model.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
