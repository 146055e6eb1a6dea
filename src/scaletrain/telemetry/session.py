"""Everything the loop tells telemetry, behind one object: phase marks, the sampled
communication, the profiler window, per-interval figures from every rank (a mixture of
experts' routing among them), and the sinks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from scaletrain.config import Config
from scaletrain.config.batch import global_batch
from scaletrain.engines.base import Mark
from scaletrain.engines.compile_stats import compile_counters
from scaletrain.launch.distributed import World
from scaletrain.telemetry.clock import PhaseClock
from scaletrain.telemetry.comm import CommSampler
from scaletrain.telemetry.device import as_json, device_info
from scaletrain.telemetry.metrics import Flushed, MetricsLog, Rates, StepRecorder
from scaletrain.telemetry.profile import ProfileWindow
from scaletrain.telemetry.syncs import HostSyncs


class Telemetry:
    def __init__(
        self,
        cfg: Config,
        world: World,
        dp_size: int,
        hosts: list[str],
        flops_per_token: float,
        run_dir: Path,
        metrics: MetricsLog,
        start_step: int,
    ):
        t = cfg.telemetry
        self.info = device_info(world.device, cfg.precision, t.peak_tflops)
        self.flops_per_token = flops_per_token
        samples = global_batch(cfg.train, dp_size)
        rates = Rates(
            tokens_per_step=samples * cfg.data.seq_len,
            samples_per_step=samples,
            flops_per_token=flops_per_token,
            peak_flops=self.info.peak_flops,
            # Replica groups: the rows are the job's (tokens of every group), so are MFU's devices.
            devices=world.world_size * cfg.fault_tolerance.groups,
            memory_bytes=self.info.memory_bytes,
            cost_per_gpu_hour=t.cost_per_gpu_hour,
            straggler_threshold=t.straggler_threshold,
            micro_batches=cfg.train.grad_accum,
        )
        self.metrics = metrics
        self.clock = PhaseClock(world.device)
        self.recorder = StepRecorder(world, hosts, self.clock, rates, metrics.gpu_hours())
        self.sampler = CommSampler(t.comm_sample_every if world.distributed else 0, world.device)
        self.window = ProfileWindow(t.profile_steps, run_dir / "profile", world.rank, world.device)
        # telemetry.host_syncs: the host reads of device tensors, counted into each interval row.
        self.syncs = HostSyncs(world.device) if t.host_syncs else None
        self.compiled = cfg.train.compile  # each interval row says what dynamo did (engines/compile_stats.py)
        # Looks over each interval's rows before they are written (the guards: the non-finite
        # one adds its counters, the spike guard its rows to the events) and may return the
        # error that stops the run, raised after.
        self.review: Callable[[list[dict[str, Any]], list[dict[str, Any]]], Exception | None] | None = None
        self.sinks = None
        if world.is_main and (t.tensorboard or t.wandb):
            from scaletrain.telemetry.sinks import Sinks  # imports its packages only when asked for

            self.sinks = Sinks(t, run_dir, cfg.model_dump(mode="json"), start_step)

    def watch_routing(self, take: Callable[[], torch.Tensor | None]) -> None:
        """Each interval's expert load from `take` (models.moe.routing_stats of the model: its
        routing statistics since the last call, reset; None for a dense model). What it
        holds now is dropped: forwards before the first step (a resumed checkpoint's
        verification, say) are no training step's."""
        take()
        self.recorder.routing = take

    def drop_routing(self) -> None:
        """Forget the routing counted since the last interval: an evaluation's forwards
        (training/evaluation.py) are no training step's."""
        self.recorder.routing()

    def run_info(self) -> dict[str, Any]:
        return {**as_json(self.info), "flops_per_token": self.flops_per_token}

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[Mark]:
        """Around the whole of optimizer step `step` (1-based), its record included; gives
        the phase marker."""
        self.window.before_step(step)
        with self.sampler.around(step, allowed=not self.window.active), self._counting("step"):
            self.clock.start()
            yield self.clock.mark
        self.window.after_step(step)

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor, **fields: Any) -> None:
        """A step's figures; tensors among them are read at the flush, not now."""
        self.recorder.record(loss, grad_norm, **fields)

    def flush(self) -> Flushed:
        """Collective: the interval's rows and figures from every rank, reviewed and written
        (rank 0); then the review's error, if it has one."""
        with self._counting("flush"):
            flushed = self.recorder.flush(self.sampler.take())
        stop = self.review(flushed.rows, flushed.events) if self.review is not None and flushed.rows else None
        if self.syncs is not None and flushed.events:
            flushed.events[0]["host_syncs"] = self.syncs.take()  # the interval's steps and this flush
        if self.compiled and flushed.events:
            flushed.events[0]["compile"] = compile_counters()  # so far in this process
        self.metrics.write_flushed(flushed)
        if self.sinks is not None:
            self.sinks.log_steps(flushed.rows)
            for event in flushed.events:
                self.sinks.log_event(event)
        if stop is not None:
            raise stop
        return flushed

    def _counting(self, kind: str) -> contextlib.AbstractContextManager[None]:
        return self.syncs.counting(kind) if self.syncs is not None else contextlib.nullcontext()

    def event(self, row: dict[str, Any]) -> None:
        self.metrics.write([row])
        if self.sinks is not None:
            self.sinks.log_event(row)

    # Stateful (training/state.py): the running totals, TrainerState's `telemetry`. A checkpoint
    # written before has none: the device-hours then stay what metrics.jsonl's last interval
    # row says (read at construction, the rows after the resumed step dropped).
    def state_dict(self) -> dict[str, Any]:
        return {"telemetry": {"gpu_hours": self.recorder.gpu_hours}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("telemetry") or {}
        if "gpu_hours" in saved:
            self.recorder.gpu_hours = float(saved["gpu_hours"])

    def close(self) -> None:
        self.window.close()
        if self.sinks is not None:
            self.sinks.close()
