"""A wsd cooldown branched from a stable-phase checkpoint (train.resume=CKPT
train.cooldown_steps=N, training/rundir.py branch_cooldown): a new run whose steps are
those of a straight wsd run of the same total length, bit for bit, the original run
untouched; and the one-line refusals (no checkpoint, its own run.dir, a checkpoint without
a stable phase or already decaying)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from scaletrain.config import load_config
from scaletrain.errors import UserError
from scaletrain.telemetry import read_metrics
from scaletrain.training.rundir import branch_cooldown

from helpers.launch import check, one_line_error, train
from helpers.runs import base_overrides, final_weights, metric_rows, trainer_state

# warmup 2, lr held, then wsd's linear decay over the last 4 steps (linear: its numbers are
# easy to read in a failure; the shape does not matter to the branch).
WSD = ["train.schedule=wsd", "train.decay_steps=4", "train.decay_shape=linear", "train.micro_batch=4"]


def _digest(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(small_dataset, tmp_path_factory):
    """The long run (12 steps: stable until step 8, checkpoints every 3) and the straight run
    of 10 steps that a cooldown of 4 from the long run's step 6 should be."""
    root = tmp_path_factory.mktemp("cooldown")
    long, straight = root / "long", root / "straight"
    check(train([*base_overrides(small_dataset, long, steps=12), *WSD, "checkpoint.every=3"]))
    check(train([*base_overrides(small_dataset, straight, steps=10), *WSD, "checkpoint.every=5"]))
    return long, straight


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_cooldown_from_a_stable_checkpoint_is_the_straight_wsd_run(runs, small_dataset, tmp_path):
    long, straight = runs
    before = _digest(long)
    branch = tmp_path / "branch"
    origin = long / "checkpoints" / "step_6"
    args = [*base_overrides(small_dataset, branch, steps=12), *WSD, f"train.resume={origin}", "train.cooldown_steps=4"]
    out = check(train([*args, "checkpoint.every=5"])).stdout
    assert f"cooldown: from {origin} (step 6 of a wsd schedule): steps 7-10 decay to train.lr x 0.1 (linear)" in out, out
    # Steps 7-10, each as the straight 10-step run took it: loss, grad norm and learning rate
    # (the decay's 4 steps), and the final weights.
    rows = read_metrics(branch / "metrics.jsonl")  # a branch's rows start after its origin
    assert [r["step"] for r in rows] == [7, 8, 9, 10]
    want = [r for r in metric_rows(straight) if r["step"] > 6]
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in rows] == [(r["loss"], r["grad_norm"], r["lr"]) for r in want]
    assert rows[-1]["lr"] < rows[0]["lr"] == metric_rows(long)[6]["lr"]  # decayed, from where the long run held it
    a, b = final_weights(branch, 10), final_weights(straight, 10)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # The long run was only read.
    assert _digest(long) == before
    # Stopped and started again with the same command, the branch goes on from its own
    # checkpoint (step 10 here, its end: nothing left to train), not from step 6 again.
    again = check(train([*args, "checkpoint.every=5"])).stdout
    assert "resumed from step_6" in out and "resumed from step_10" in again, again
    assert [r["step"] for r in read_metrics(branch / "metrics.jsonl")] == [7, 8, 9, 10]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_cooldown_from_a_decaying_checkpoint_is_one_line_and_from_a_stable_one_trains(runs, small_dataset, tmp_path):
    long, straight = runs
    for origin, said in (
        (long / "checkpoints" / "step_9", "is in its decay (from step 8); accepted: a checkpoint of its stable phase"),
        (straight / "checkpoints" / "step_5", None),  # straight decays from step 6: step 5 is stable
    ):
        run = tmp_path / origin.name
        proc = train([*base_overrides(small_dataset, run), *WSD, f"train.resume={origin}", "train.cooldown_steps=2"])
        if said:
            one_line_error(proc, "train.cooldown_steps", said)
        else:
            check(proc)
            assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [6, 7]


def _checkpoint(at: Path, step: int, *overrides: str) -> Path:
    """A checkpoint directory as far as branch_cooldown reads it: trainer.json and config.yaml."""
    ckpt = at / "checkpoints" / f"step_{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(trainer_state(step=step).to_json())
    (ckpt / "config.yaml").write_text(load_config([], ["train.steps=100", "train.warmup_steps=10", *overrides]).to_yaml())
    return ckpt


@pytest.mark.unit
@pytest.mark.parametrize(
    ("step", "overrides", "said"),
    [
        (50, ["train.schedule=cosine"], "step 50 of a cosine schedule) has none: its learning rate decays from the warmup on"),
        (5, ["train.schedule=wsd"], "is still in its warmup (10 steps); accepted: a checkpoint past it"),
        (81, ["train.schedule=wsd"], "is in its decay (from step 80)"),  # a fifth of 100
        (60, ["train.schedule=wsd", "train.decay_steps=50"], "is in its decay (from step 50)"),
    ],
    ids=["cosine", "warmup", "decay", "decay-steps"],
)
def test_a_checkpoint_without_a_stable_phase_to_branch_from_is_refused(tmp_path, step, overrides, said):
    ckpt = _checkpoint(tmp_path / "run", step, *overrides)
    cfg = load_config([], [f"train.resume={ckpt}", "train.cooldown_steps=4"])
    with pytest.raises(UserError, match=said.replace("(", r"\(").replace(")", r"\)")):
        branch_cooldown(cfg, ckpt, tmp_path / "branch")


@pytest.mark.unit
def test_a_branch_gets_a_straight_wsd_runs_settings_and_never_the_origins_run_dir(tmp_path):
    ckpt = _checkpoint(tmp_path / "run", 40, "train.schedule=constant")
    cfg = load_config([], [f"train.resume={ckpt}", "train.cooldown_steps=15", "train.min_lr_ratio=0"])
    branched, line = branch_cooldown(cfg, ckpt, tmp_path / "branch")
    t = branched.train
    assert (t.steps, t.schedule, t.decay_steps, t.min_lr_ratio, t.cooldown_steps) == (55, "wsd", 15, 0.0, 15)
    assert line.startswith(f"cooldown: from {ckpt} (step 40 of a constant schedule): steps 41-55 decay to train.lr x 0")
    with pytest.raises(UserError, match="is that checkpoint's own run; accepted: another run.dir"):
        branch_cooldown(cfg, ckpt, tmp_path / "run")


@pytest.mark.unit
def test_a_cooldown_without_a_checkpoint_is_one_line():
    with pytest.raises(UserError, match="train.resume=auto names none; accepted: train.resume=RUN/checkpoints/step_N"):
        load_config([], ["train.cooldown_steps=4"])
