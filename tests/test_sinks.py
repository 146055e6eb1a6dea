"""The optional sinks, read back from what they leave on disk: TensorBoard event files
(TFRecord framing parsed here, every CRC checked) and the W&B offline datastore
(run-<id>.wandb: LevelDB-log framing of wandb_internal_pb2.Record, parsed here; wandb
0.31 has no reader and writes no files/wandb-summary.json offline)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from scaletrain.config import TelemetryConfig
from scaletrain.errors import UserError
from scaletrain.telemetry.sinks import Sinks

from sink_readers import offline_runs, tensorboard_scalars, wandb_history, wandb_records

pytestmark = pytest.mark.unit

CONFIG = {"model": {"preset": "tiny", "dim": 64}, "train": {"lr": 0.003}}


def step_row(step: int, loss: float, **extra: Any) -> dict[str, Any]:
    return {"step": step, "loss": loss, "grad_norm": 1.0 / step, "lr": 1e-3 * step, "tokens_per_s": 1000.0 + step,
            "step_time_s": 0.5, "tokens": 256 * step, "nonfinite_steps": 0, "rollbacks": 0, **extra}  # fmt: skip


INTERVAL = {
    "step": 4, "event": "interval", "steps": 4, "wall_s": 2.5, "step_s": 0.625, "tokens_per_s": 1638.4,
    "samples_per_s": 25.6, "effective_batch": 16, "mfu": None, "mem_peak_bytes": 123456789, "mem_capacity_bytes": 10**10,
    "gpu_util": None, "gpu_hours": 0.01, "cost": None,
    "phases": {"data_s": 0.01, "forward_s": 0.2, "backward_s": 0.3, "optimizer_s": 0.05, "comm_s": 0.06, "other_s": 0.005},
}  # fmt: skip


# An evaluation's row (training/evaluation.py): its numbers become eval/<key>.
EVAL = {"step": 4, "event": "eval", "loss": 4.75, "perplexity": 115.58428452718766, "tokens": 512, "samples": 8,
        "data": "eval.split=0.01 (3 of 300 documents)", "eval_s": 0.125}  # fmt: skip


# Downstream tasks' rows (training/tasks.py): tasks/<name>/<key>.
TASKS = [
    {"step": 4, "event": "task", "task": "arc", "kind": "multiple_choice", "acc": 0.5, "acc_norm": 0.75, "items": 8,
     "shots": 0, "eval_s": 0.5},
    {"step": 4, "event": "task", "task": "lambada", "kind": "last_word", "acc": 0.25, "perplexity": 12.5, "items": 8,
     "shots": 0, "eval_s": 0.25},
]  # fmt: skip


# ---------------------------------------------------------------------------- tests


def test_both_sinks_write_what_metrics_jsonl_holds(tmp_path):
    run = tmp_path / "run"
    sinks = Sinks(TelemetryConfig(tensorboard=True, wandb=True, wandb_project="proj"), run, CONFIG, resumed_step=0)
    losses = {1: 5.5, 2: 5.25, 3: 5.125, 4: 4.9375}
    sinks.log_steps([step_row(s, loss) for s, loss in losses.items() if s < 4])
    sinks.log_steps([step_row(4, losses[4], loss_scale=65536.0, skipped=True)])
    sinks.log_event(INTERVAL)
    sinks.log_event({"step": 4, "event": "checkpoint", "async": True, "blocking_s": 0.25, "waited_for_previous_s": 0.0})
    sinks.log_event({"step": 4, "event": "straggler", "rank": 1, "host": "node7", "step_s": 0.8, "excess": 0.3})
    sinks.log_event({"step": 4, "event": "replicas_disagree", "what": "weights", "ranks": [0, 1], "groups": [[0], [1]]})
    sinks.log_event(EVAL)
    for task in TASKS:
        sinks.log_event(task)
    sinks.close()

    tb = tensorboard_scalars(run / "tensorboard")
    assert tb["train/loss"] == losses  # exact: each value is a power-of-two fraction, float32 holds it
    assert tb["train/lr"] == pytest.approx({s: 1e-3 * s for s in losses}, rel=1e-6)
    assert tb["train/grad_norm"] == pytest.approx({s: 1.0 / s for s in losses}, rel=1e-6)
    assert tb["train/loss_scale"] == {4: 65536.0} and tb["train/skipped"] == {4: 1.0}
    assert tb["throughput/tokens_per_s"] == pytest.approx({4: 1638.4}, rel=1e-6)
    assert tb["memory/peak_bytes"] == pytest.approx({4: 123456789}, rel=1e-6)
    assert tb["phases/comm_s"] == pytest.approx({4: 0.06}, rel=1e-6)
    assert {t for t in tb if t.startswith("phases/")} == {f"phases/{k}" for k in INTERVAL["phases"]}
    assert tb["checkpoint/blocking_s"] == {4: 0.25} and tb["straggler/excess"] == pytest.approx({4: 0.3})
    assert tb["eval/loss"] == {4: 4.75} and tb["eval/perplexity"] == pytest.approx({4: 115.58428452718766}, rel=1e-6)
    assert tb["eval/tokens"] == {4: 512} and "eval/data" not in tb
    # Each task's figures under its own name (two tasks at one step must not share a tag).
    assert tb["tasks/arc/acc"] == {4: 0.5} and tb["tasks/arc/acc_norm"] == {4: 0.75} and tb["tasks/lambada/acc"] == {4: 0.25}
    assert tb["tasks/lambada/perplexity"] == pytest.approx({4: 12.5}) and "tasks/arc/task" not in tb and "task/acc" not in tb
    assert "throughput/mfu" not in tb and "system/gpu_util" not in tb  # null: unknown, not zero
    assert not [t for t in tb if t.startswith("replicas_disagree/") or t == "straggler/host"]  # no numbers in them

    [offline] = offline_runs(run)
    [run_file] = offline.glob("run-*.wandb")
    records = wandb_records(run_file)
    kinds = {r.WhichOneof("record_type") for r in records}
    assert "stats" not in kinds  # no system-metrics sampling
    [run_record] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_record.project == "proj"
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["model"] == CONFIG["model"] and config["resumed_step"] == 0
    history = wandb_history(records)
    assert sorted(history) == [1, 2, 3, 4]
    assert {s: h["train/loss"] for s, h in history.items()} == losses
    # Step 4's row holds the step row and the events logged at step 4, in one history row.
    assert history[4]["phases/comm_s"] == 0.06 and history[4]["throughput/tokens_per_s"] == 1638.4
    assert history[4]["checkpoint/async"] == 1 and "throughput/mfu" not in history[4]
    assert history[4]["eval/loss"] == 4.75 and history[4]["eval/perplexity"] == pytest.approx(115.58428452718766)
    assert history[4]["tasks/arc/acc_norm"] == 0.75 and history[4]["tasks/lambada/acc"] == 0.25


def test_resume_neither_sink_keeps_undone_steps(tmp_path):
    run = tmp_path / "run"
    cfg = TelemetryConfig(tensorboard=True, wandb=True)
    first = Sinks(cfg, run, CONFIG, resumed_step=0)
    first.log_steps([step_row(s, 10.0 + s) for s in range(1, 7)])  # killed after 6, checkpoint at 4
    first.close()
    again = Sinks(cfg, run, CONFIG, resumed_step=4)
    again.log_steps([step_row(s, 20.0 + s) for s in (5, 6, 7)])
    again.close()

    before, after = {s: 10.0 + s for s in range(1, 5)}, {s: 20.0 + s for s in (5, 6, 7)}
    assert tensorboard_scalars(run / "tensorboard")["train/loss"] == {**before, **after}
    # W&B: a new offline run per start, holding only what this start wrote.
    runs = offline_runs(run)
    assert len(runs) == 2
    later = [r for r in runs if sorted(wandb_history(wandb_records(next(r.glob("run-*.wandb"))))) == [5, 6, 7]]
    assert len(later) == 1


def test_disabled_sinks_do_nothing(tmp_path, monkeypatch):
    # Neither package is even imported when its sink is off.
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    sinks = Sinks(TelemetryConfig(), tmp_path / "run", CONFIG, resumed_step=0)
    sinks.log_steps([step_row(1, 1.0)])
    sinks.log_event(INTERVAL)
    sinks.close()
    assert not sinks.enabled and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("key", "module"), [("tensorboard", "tensorboardX"), ("wandb", "wandb")])
def test_missing_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, key, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(UserError) as err:
        Sinks(TelemetryConfig(**{key: True}), tmp_path / "run", CONFIG, resumed_step=0)
    message = str(err.value)
    assert "\n" not in message
    assert f"telemetry.{key}=true" in message and f"pip install 'scaletrain[{key}]'" in message


def test_wandb_never_looks_up_a_host(tmp_path):
    """In a process of its own, to its exit (wandb's telemetry exporter would flush at exit):
    every name lookup and connection that is not a Unix socket is recorded."""
    script = textwrap.dedent(
        f"""
        import socket, sys
        seen = []
        real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect
        def getaddrinfo(host, *a, **k):
            seen.append(f"lookup {{host}}")
            raise OSError("no network in this test")
        def connect(self, address):
            if self.family != socket.AF_UNIX:
                seen.append(f"connect {{address}}")
            return real_connect(self, address)
        socket.getaddrinfo, socket.socket.connect = getaddrinfo, connect
        import atexit
        atexit.register(lambda: open({str(tmp_path / "network.txt")!r}, "w").write("\\n".join(seen)))
        from pathlib import Path
        from scaletrain.config import TelemetryConfig
        from scaletrain.telemetry.sinks import Sinks
        sinks = Sinks(TelemetryConfig(wandb=True), Path({str(tmp_path / "run")!r}), {{}}, resumed_step=0)
        sinks.log_steps([{{"step": 1, "loss": 1.0}}])
        sinks.close()
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "network.txt").read_text() == ""
