"""train.nonfinite: a NaN step (injected with SCALETRAIN_KILL_AT=nan:STEP, the loss made NaN
inside the graph, so the gradients are too) is never applied; skip goes on, rollback goes
back to the newest checkpoint and past the bad data, abort stops; counters in metrics.jsonl."""

from __future__ import annotations

import json
import math
import shutil
import zlib

import pytest
import torch

import scaletrain.training.trainer as trainer
from scaletrain import checkpoint
from scaletrain.config import load_config
from scaletrain.resilience import faults
from scaletrain.resilience.nonfinite import Diverged

from helpers.launch import check, train
from helpers.runs import base_overrides, checkpoint_state, metric_rows

pytestmark = pytest.mark.e2e

GLOBAL_BATCH = 2  # micro_batch 2, world 1


def run(tmp_path, monkeypatch, fault: str, *overrides: str):
    monkeypatch.setattr(faults, "_ARMED", faults.parse(fault)[0][:2])  # as SCALETRAIN_KILL_AT=<fault> at start
    cfg = load_config([], [*base_overrides(tmp_path.parent / "data", tmp_path, steps=6), "train.micro_batch=2", *overrides])
    return trainer.train(cfg)


@pytest.fixture
def data(small_dataset, tmp_path):
    (tmp_path / "data").symlink_to(small_dataset)


@pytest.mark.timeout(300)
def test_skip_leaves_weights_and_optimizer_untouched_and_counts(data, tmp_path, monkeypatch):
    run_dir = tmp_path / "skip"
    run(run_dir, monkeypatch, "nan:3", "checkpoint.every=1", "checkpoint.keep=10", "train.log_every=1")
    assert_skipped_step_3(run_dir)


@pytest.mark.timeout(300)
def test_deepspeed_skips_too_and_a_nan_on_one_rank_stops_all(data, tmp_path):
    """ZeRO-2 relies on DeepSpeed's own check of the global gradient norm (fp32 included);
    the NaN is on rank 1 only, the step is skipped on both ranks and counted by both."""
    run_dir = tmp_path / "zero2"
    args = [*base_overrides(tmp_path / "data", run_dir, steps=6), "train.micro_batch=1", "parallel.strategy=zero2"]
    check(train([*args, "checkpoint.every=1", "checkpoint.keep=10", "train.log_every=1"], nproc=2, env={faults.ENV: "nan:3@1"}))
    assert_skipped_step_3(run_dir)


def assert_skipped_step_3(run_dir):
    rows = metric_rows(run_dir)
    assert math.isnan(rows[2]["loss"]) and all(math.isfinite(r["loss"]) for i, r in enumerate(rows) if i != 2)
    assert [r["nonfinite_steps"] for r in rows] == [0, 0, 1, 1, 1, 1] and {r["rollbacks"] for r in rows} == {0}
    before, skipped, after = (checkpoint_state(run_dir, s) for s in (2, 3, 4))
    # The NaN step changed nothing: every weight, both Adam moments and Adam's step count.
    assert checkpoint.restore.first_difference(skipped, before) is None
    assert checkpoint.restore.first_difference(after, skipped) is not None  # and the next step trained
    steps = {v.item() for k, v in after["optim"].items() if k.endswith(".step")}
    assert steps == {3.0}, steps  # 4 steps run, 3 applied
    assert all(torch.isfinite(w).all() for w in after["model"].values())
    assert json.loads((run_dir / "checkpoints" / "step_6" / "trainer.json").read_text())["nonfinite"] == {
        "nonfinite_steps": 1,
        "rollbacks": 0,
    }


def test_abort_stops_at_the_first_nonfinite_step(data, tmp_path, monkeypatch):
    with pytest.raises(Diverged, match=r"step 2: non-finite loss; train.nonfinite=abort stopped the run.*step_1"):
        run(tmp_path / "abort", monkeypatch, "nan:2", "checkpoint.every=1", "train.nonfinite=abort")
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path / "abort" / "checkpoints")] == [1]


def test_the_guard_reads_at_the_end_of_the_interval(data, tmp_path, monkeypatch):
    # A step reads nothing from the device (docs/gpu.md): the NaN at step 2 is seen where the
    # interval of 4 is read, after step 4; its rows are written with the counters, none saved.
    run_dir = tmp_path / "abort4"
    with pytest.raises(Diverged, match=r"^step 2: non-finite loss; train.nonfinite=abort stopped the run .*no checkpoint yet"):
        run(run_dir, monkeypatch, "nan:2", "checkpoint.every=0", "train.log_every=4", "train.nonfinite=abort")
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and math.isnan(rows[1]["loss"])
    assert [r["nonfinite_steps"] for r in rows] == [0, 1, 1, 1]
    assert not list((run_dir / "checkpoints").glob("step_*"))


def test_a_rollback_with_no_checkpoint_stops_in_one_line(data, tmp_path, monkeypatch):
    # The guard calls for the rollback; the saves find nothing to go back to; the guard's line.
    with pytest.raises(Diverged, match=r"^steps 2-2: 1 non-finite steps in a row and no valid checkpoint to roll back to; "):
        run(tmp_path / "nothing", monkeypatch, "nan:2", "checkpoint.every=0", "train.log_every=1",
            "train.nonfinite=rollback", "train.nonfinite_patience=1")  # fmt: skip


@pytest.mark.timeout(300)
def test_rollback_reloads_the_checkpoint_and_skips_the_bad_data(data, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "rollback"
    # Step 4 trained after the checkpoint at 3: going back to it undoes a real step.
    run(
        run_dir,
        monkeypatch,
        "nan:5",
        "checkpoint.every=3",
        "checkpoint.keep=10",
        "train.nonfinite=rollback",
        "train.nonfinite_patience=1",
    )
    assert "rolled back to step 3 (rollback 1); the data since it is skipped" in capsys.readouterr().out
    rows = metric_rows(run_dir)  # one row per step, the undone step's row replaced
    assert len(rows) == 6 and all(math.isfinite(r["loss"]) for r in rows)
    assert [(r["nonfinite_steps"], r["rollbacks"]) for r in rows] == [(0, 0)] * 3 + [(1, 1)] * 3
    saved = json.loads((run_dir / "checkpoints" / "step_6" / "trainer.json").read_text())
    # 6 steps applied on 8 batches: the batches of steps 4 and 5 (the NaN one) were passed over.
    assert saved["data_position"] == 8 * GLOBAL_BATCH and saved["step"] == 6

    # What the rollback should equal, done by hand: a fresh process resumes the step_3
    # checkpoint with its data position moved past two batches, and trains steps 4 to 6.
    ref = tmp_path / "by_hand"
    shutil.copytree(run_dir / "checkpoints" / "step_3", ref / "checkpoints" / "step_3")
    _edit_trainer_json(ref / "checkpoints" / "step_3", data_position=5 * GLOBAL_BATCH)
    (ref / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    overrides = [*base_overrides(tmp_path / "data", ref, steps=6), "train.micro_batch=2", "checkpoint.every=3"]
    check(train(overrides))
    assert [r["loss"] for r in metric_rows(ref)] == [r["loss"] for r in rows]
    assert checkpoint.restore.first_difference(checkpoint_state(ref, 6), checkpoint_state(run_dir, 6)) is None


def _edit_trainer_json(ckpt, **changes):
    """Change trainer.json and its manifest entry, as a save with those values would have written it."""
    f = ckpt / "trainer.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **changes}, indent=1))
    marker = json.loads((ckpt / checkpoint.MARKER).read_text())
    marker["files"]["trainer.json"] = [f.stat().st_size, zlib.crc32(f.read_bytes())]
    (ckpt / checkpoint.MARKER).write_text(json.dumps(marker))
