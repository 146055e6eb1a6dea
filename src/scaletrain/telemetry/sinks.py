"""Optional sinks beside metrics.jsonl: TensorBoard event files and W&B offline runs (rank 0).

Both get the same tags: a step row's fields under train/ (train/loss, train/grad_norm,
train/lr, ...), the interval event's under throughput/, memory/, system/, cost/ and
phases/ (phases/comm_s ...), a mixture of experts' under moe/aux (the layers' terms summed)
and moe/layer<i>/ (imbalance, aux, balance, z, dropped: the per-expert loads stay in metrics.jsonl), a data mixture's under data/source<i>/
(share, total_share, epochs), any other event's numbers under
<event>/<key> (checkpoint/blocking_s, straggler/excess). The trainer hands rows over once
per log interval, as it writes metrics.jsonl; neither sink is flushed here beyond what its
library does by itself (tensorboardX: every 120 s or 10 queued events, from its own thread).

W&B never touches the network: offline mode, no system-stats sampling, no metadata, git or
code capture, and wandb.setup(mode="offline") first, because wandb 0.31 decides whether
to send its own usage telemetry (OpenTelemetry, to api.forge.coreweave.com) from the
process-wide settings, not from init's: without it a background thread resolves that host
(seen with strace and a getaddrinfo spy) even for an offline run. In 0.31 an offline run
leaves only run-<id>.wandb (the records: run, config, history, summary) under
<run_dir>/wandb/offline-run-*/; files/ stays empty (no wandb-summary.json, no config.yaml).
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

from scaletrain.config import TelemetryConfig
from scaletrain.errors import UserError

# Step row field -> tag. Fields not listed (none today) go under train/ as they are.
STEP_TAGS = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",  # this step alone; throughput/tokens_per_s is the interval's
    "step_time_s": "train/step_time_s",
    "tokens": "train/tokens",
    "nonfinite_steps": "train/nonfinite_steps",
    "rollbacks": "train/rollbacks",
    "loss_scale": "train/loss_scale",
    "skipped": "train/skipped",
}
# The interval event's fields -> tag (docs/telemetry.md); "phases" is a dict, flattened.
INTERVAL_TAGS = {
    "tokens_per_s": "throughput/tokens_per_s",
    "samples_per_s": "throughput/samples_per_s",
    "mfu": "throughput/mfu",
    "step_s": "throughput/step_s",
    "wall_s": "throughput/interval_wall_s",
    "steps": "throughput/interval_steps",
    "effective_batch": "throughput/effective_batch",
    "mem_peak_bytes": "memory/peak_bytes",
    "mem_capacity_bytes": "memory/capacity_bytes",
    "gpu_util": "system/gpu_util",
    "gpu_hours": "cost/gpu_hours",
    "cost": "cost/total",
}
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # config key -> pip extra


class Sinks:
    """The enabled sinks of one run, on rank 0 only; with none enabled every call does nothing."""

    def __init__(self, cfg: TelemetryConfig, run_dir: Path, config: dict[str, Any], resumed_step: int):
        self._tb: _TensorBoard | None = None
        self._wandb: Any = None
        self._wandb_step = -1  # the last step given to W&B, which drops any step below it
        run_dir = Path(run_dir)
        # Both packages first: a missing one stops the run before the other sink has started.
        wandb = _require("wandb", "wandb") if cfg.wandb else None
        if cfg.tensorboard:
            _require("tensorboardX", "tensorboard")
            self._tb = _TensorBoard(run_dir / "tensorboard", resumed_step)
        if wandb is not None:
            settings = wandb.Settings(
                mode="offline",
                x_disable_stats=True,  # no sampling thread for CPU/GPU/memory
                x_disable_meta=True,
                x_disable_machine_info=True,
                x_save_requirements=False,
                disable_git=True,
                disable_code=True,
                save_code=False,
                console="off",  # the terminal is not captured (it would wrap stdout/stderr)
                silent=True,
            )
            wandb.setup(settings=settings)  # see the module doc: the process-wide offline switch
            run_dir.mkdir(parents=True, exist_ok=True)
            # One offline run per process start: a resumed run is a new W&B run (its steps
            # continue from resumed_step + 1), so nothing already written is written twice.
            self._wandb = wandb.init(
                mode="offline",
                dir=str(run_dir),
                project=cfg.wandb_project,
                name=run_dir.name,
                config={**config, "resumed_step": resumed_step},
                settings=settings,
            )

    @property
    def enabled(self) -> bool:
        return self._tb is not None or self._wandb is not None

    def log_steps(self, rows: list[dict[str, Any]]) -> None:
        """metrics.jsonl step rows (keys: step, loss, grad_norm, lr, ...)."""
        if not self.enabled:
            return
        for row in rows:
            scalars = {STEP_TAGS.get(k, f"train/{k}"): v for k, v in row.items() if k != "step"}
            self._write(row["step"], scalars)

    def log_event(self, row: dict[str, Any]) -> None:
        """A metrics.jsonl event row ({"step", "event": kind, ...}): its numbers; the rest is skipped."""
        if not self.enabled:
            return
        kind = row["event"]
        scalars: dict[str, Any] = {}
        for k, v in row.items():
            if k in ("step", "event"):
                continue
            if kind == "interval" and k == "phases" and isinstance(v, dict):
                scalars.update({f"phases/{name}": x for name, x in v.items()})
            elif kind == "interval" and k == "moe" and isinstance(v, dict):
                scalars.update(_moe_scalars(v))
            elif kind == "interval" and k == "mix" and isinstance(v, dict):
                scalars.update(_mix_scalars(v))
            elif kind == "interval" and k == "lr_groups" and isinstance(v, list):
                scalars.update({f"lr/group_{g['group']}": g["lr"] for g in v})
            elif kind == "interval":
                scalars[INTERVAL_TAGS.get(k, f"interval/{k}")] = v
            elif kind == "task":  # eval.tasks: one row per task, its figures under its name
                scalars[f"tasks/{row['task']}/{k}"] = v
            else:
                scalars.update(_flatten(f"{kind}/{k}", v))
        self._write(row["step"], scalars)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
            # finish() returns once wandb-core has the exit record, not once it has written
            # the run file: 5 runs in 40 still had an empty run-*.wandb right after it (a
            # second later all was there). teardown waits for wandb-core to stop, so the file
            # is complete when close() returns, and a process exiting next loses nothing.
            import wandb

            wandb.teardown()

    def _write(self, step: int, scalars: dict[str, Any]) -> None:
        numbers = {tag: float(v) for tag, v in scalars.items() if _is_number(v)}
        if not numbers:
            return
        if self._tb is not None:
            self._tb.write(step, numbers)
        # W&B keeps one history row per step and drops (with a warning) a step below the
        # last one; a rollback re-logs undone steps, which it would only refuse noisily.
        if self._wandb is not None and step >= self._wandb_step:
            self._wandb.log(numbers, step=step)
            self._wandb_step = step


class _TensorBoard:
    """Event files through tensorboardX's FileWriter, one event per step holding every scalar
    of it: 110 us per step row of 8 scalars, where SummaryWriter.add_scalar (an event per
    scalar, and a Comet hook per call) took 615 us. Same file format, same tags."""

    def __init__(self, logdir: Path, resumed_step: int):
        from tensorboardX import FileWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary

        self._summary, self._value = Summary, Summary.Value
        # The suffix keeps two starts within one second (the file name holds whole seconds)
        # from sharing, and overwriting, one file; names still sort by start, the order
        # TensorBoard reads them (and applies a purge) in.
        self._writer = FileWriter(str(logdir), filename_suffix=f".{time.time_ns()}")
        if resumed_step > 0:
            # What SummaryWriter(purge_step=) writes: TensorBoard hides the events at and after
            # this step that earlier files hold, the steps the trainer drops from
            # metrics.jsonl on resume and runs again.
            purge = resumed_step + 1
            self._writer.add_event(Event(step=purge, file_version="brain.Event:2"))
            self._writer.add_event(Event(step=purge, session_log=SessionLog(status=SessionLog.START)))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        values = [self._value(tag=tag, simple_value=v) for tag, v in scalars.items()]
        self._writer.add_summary(self._summary(value=values), global_step=step)

    def close(self) -> None:
        self._writer.close()  # flushes the queue and ends the writer's thread


def _require(module: str, key: str) -> Any:
    """Import an optional sink's package, or stop with the one line that says how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"telemetry.{key}=true needs the {module} package, which is not installed; "
            f"install it with: pip install 'scaletrain[{EXTRAS[key]}]' (or set telemetry.{key}=false)"
        ) from None


def _moe_scalars(moe: dict[str, Any]) -> dict[str, Any]:
    # A few numbers per layer: a scalar per expert (64 experts x 27 layers in DeepSeekMoE)
    # would bury the dashboard; diagnose's heat map shows the loads (report.html).
    return {"moe/aux": moe.get("aux")} | {
        f"moe/layer{i}/{key}": layer.get(key)
        for i, layer in enumerate(moe.get("layers") or [])
        for key in ("imbalance", "aux", "balance", "z", "dropped")
    }


def _mix_scalars(mix: dict[str, Any]) -> dict[str, Any]:
    # A data mixture (data/mix.py): per source, the interval's share, the run's and its epochs.
    return {f"data/source{i}/{key}": x for key in ("share", "total_share", "epochs") for i, x in enumerate(mix.get(key) or [])}


def _flatten(prefix: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(f"{prefix}/{k}", v))
        return out
    return {prefix: value}


def _is_number(v: Any) -> bool:
    # bool counts (skipped, async: 0/1), NaN and inf too (a non-finite loss is news); None
    # (an unknown mfu), strings and lists do not.
    return isinstance(v, (int, float))
