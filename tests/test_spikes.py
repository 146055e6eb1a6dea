"""train.spikes (resilience/spikes.py): finite loss and gradient-norm spikes over a trailing
window's median and MAD; a gradient-norm spike's update held back on the device, then a lower
learning rate, then a rollback past the data; each decision a row with the samples and the
documents they came from; the window saved with the run. The planted spike is
SCALETRAIN_KILL_AT=spike:STEP (the loss and its gradients x 1000, resilience/faults.py)."""

from __future__ import annotations

import json

import pytest

import scaletrain.training.trainer as trainer
from scaletrain import checkpoint
from scaletrain.config import load_config
from scaletrain.config.spikes import SpikesSection
from scaletrain.errors import UserError
from scaletrain.resilience import faults
from scaletrain.resilience.nonfinite import Diverged
from scaletrain.resilience.spikes import SpikeGuard, limit_of
from scaletrain.telemetry.metrics import read_metrics

from helpers.runs import STDLIB, base_overrides, checkpoint_state, copy_until, metric_rows

ON = SpikesSection(enabled=True, window=8, min_steps=4, threshold=6.0, lr_after=2, lr_factor=0.5, lr_steps=3, rollback_after=3)


def rows(values: list[tuple[float, float]], first: int = 1) -> list[dict]:
    return [{"step": first + i, "loss": loss, "grad_norm": norm} for i, (loss, norm) in enumerate(values)]


# -- the guard's decisions (host only) --------------------------------------------------------


@pytest.mark.unit
def test_the_threshold_is_the_median_plus_threshold_robust_sigmas():
    # median 3, MAD median(2, 1, 0, 1, 97) = 1: 3 + 6 x 1.4826
    assert limit_of([1, 2, 3, 4, 100], ON) == pytest.approx(3 + 6 * 1.4826)
    # near-equal values: the spread's floor, 2% of the median
    assert limit_of([5.0, 5.0, 5.0, 5.0], ON) == pytest.approx(5 + 6 * 0.1)
    assert limit_of([5.0, 5.0, 5.0], ON) is None  # fewer than min_steps: nothing judged


@pytest.mark.unit
def test_a_gradient_spike_is_held_back_then_the_rate_lowered_then_a_rollback():
    guard = SpikeGuard(ON)
    assert guard.limit() is None and guard.review(rows([(5.0, 1.0)] * 4)) == []
    assert guard.limit() == pytest.approx(1.0 + 6 * 0.5)  # the gradient norm floor; the device's limit until the next read
    guard.took(5, 20, 24)
    first = guard.review(rows([(5.0, 9.0), (5.0, 1.0)], first=5))
    assert [(r["step"], r["metric"], r["action"], r["samples"]) for r in first] == [(5, "grad_norm", "update skipped", [20, 24])]
    assert guard.lr_scale(7) == 1.0
    loss_only = guard.review(rows([(50.0, 1.0)], first=7))  # a loss spike alone: its step was applied
    assert loss_only[0]["metric"] == "loss" and loss_only[0]["action"] == "applied; lr x 0.5 to step 10"
    assert [guard.lr_scale(s) for s in (8, 10, 11)] == [0.5, 0.5, 1.0]
    assert not guard.rollback_due
    third = guard.review(rows([(5.0, 30.0)], first=8))
    assert third[0]["action"] == "rollback" and guard.rollback_due
    back = guard.rolled_back(4, 40)
    assert back["action"] == "rolled back" and [r["step"] for r in back["spikes"]] == [5, 7, 8] and not guard.rollback_due
    for _ in range(2):  # three rollbacks to one checkpoint in all; a fourth stops the run
        guard.rolled_back(4, 40)
    with pytest.raises(Diverged, match="spikes again after 3 rollbacks to step 4"):
        guard.rolled_back(4, 40)


@pytest.mark.unit
def test_spikes_leave_the_window_and_old_ones_age_out():
    guard = SpikeGuard(ON)
    guard.review(rows([(5.0, 1.0)] * 8))
    guard.review(rows([(5.0, 100.0)], first=9))
    assert max(guard.window["grad_norm"]) == 1.0  # the spike is not part of what is normal
    guard.review(rows([(5.0, 1.0)] * 8, first=10))
    later = guard.review(rows([(5.0, 100.0)], first=18))  # 9 steps later: the first aged out of the window of 8
    assert later[0]["spikes_in_window"] == 1 and "lr" not in later[0]["action"]


@pytest.mark.unit
def test_a_resumed_guard_decides_as_the_one_that_ran_on():
    history = rows([(5.0 - 0.1 * i, 2.0 + (i % 3) * 0.1) for i in range(10)] + [(4.0, 40.0), (3.9, 2.0), (30.0, 2.0), (3.8, 2.1)])
    straight = SpikeGuard(ON)
    straight.review(history[:6])
    saved = json.loads(json.dumps(straight.state_dict()))  # as trainer.json holds it
    resumed = SpikeGuard(ON)
    resumed.load_state_dict(saved)
    assert straight.review(history[6:]) == resumed.review(history[6:])
    assert straight.state_dict() == resumed.state_dict() and straight.lr_until == resumed.lr_until > 0


@pytest.mark.unit
def test_the_guard_off_decides_nothing_and_saves_nothing():
    guard = SpikeGuard(SpikesSection())
    assert guard.review(rows([(5.0, 1.0)] * 60 + [(5000.0, 1000.0)])) == []
    assert guard.limit() is None and guard.lr_scale(61) == 1.0 and guard.state_dict() == {}


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.strategy=zero2"], "train.spikes does not run with parallel.strategy=zero2: DeepSpeed computes"),
        (["precision=fp16"], "train.spikes does not run with precision=fp16"),
        (["train.spikes.min_steps=200"], "train.spikes.min_steps=200 exceeds train.spikes.window=100"),
    ],
)
def test_where_the_guard_cannot_hold_a_step_back_is_one_line(overrides, message):
    with pytest.raises(UserError, match=message) as e:
        load_config([], ["train.spikes.enabled=true", *overrides])
    assert "\n" not in str(e.value)


# -- in a run ------------------------------------------------------------------------------------

GUARD = [
    "train.spikes.enabled=true", "train.spikes.window=8", "train.spikes.min_steps=5",
    # Far above this tiny model's first steps (their losses fall by ~1 a step: a MAD of ~0.5), far
    # below the planted spike's x 1000: only the plant is a spike.
    "train.spikes.threshold=50",
]  # fmt: skip


@pytest.fixture
def data(small_dataset, tmp_path):
    (tmp_path / "data").symlink_to(small_dataset)
    return tmp_path / "data"


def run(tmp_path, monkeypatch, name, fault=None, *overrides, steps=10):
    monkeypatch.setattr(faults, "_ARMED", faults.parse(fault)[0][:2] if fault else None)
    cfg = load_config([], [*base_overrides(tmp_path / "data", tmp_path / name, steps=steps), "train.micro_batch=2", *overrides])
    trainer.train(cfg)
    return tmp_path / name


def spikes(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl", events=True) if r.get("event") == "spike"]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_planted_spike_is_held_back_and_named_to_its_documents(data, tmp_path, monkeypatch):
    """Planted bug it catches: the engine not given the limit (the spike applied) moves the
    weights of step 8."""
    run_dir = run(tmp_path, monkeypatch, "spiked", "spike:8", *GUARD, "checkpoint.every=1", "checkpoint.keep=20")
    (row,) = spikes(run_dir)
    assert (row["step"], row["metric"], row["action"]) == (8, "loss", "update skipped")
    assert row["value"] > 1000 and row["also"]["grad_norm"]["value"] > row["also"]["grad_norm"]["threshold"]
    assert row["samples"] == [14, 16]  # step 8 of 2 samples a step
    for origin in row["origin"]:  # each sample's shard, offset, and the stdlib file and document it came from
        assert origin["shard"].startswith("shard_") and origin["offset"] >= 0
        assert origin["file"].startswith(str(STDLIB)) and origin["file"].endswith(".py") and origin["document"] == 0
    # Held back: every weight, both moments and Adam's step count as after step 7; step 9 trained.
    before, spiked, after = (checkpoint_state(run_dir, s) for s in (7, 8, 9))
    assert checkpoint.restore.first_difference(spiked, before) is None
    assert checkpoint.restore.first_difference(after, spiked) is not None
    assert {v.item() for k, v in checkpoint_state(run_dir, 10)["optim"].items() if k.endswith(".step")} == {9.0}
    saved = json.loads((run_dir / "checkpoints" / "step_10" / "trainer.json").read_text())["spikes"]
    assert saved["count"] == 1 and saved["recent"] == [8] and len(saved["window"]["loss"]) == 8


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_guard_without_a_spike_is_the_run_without_it_bit_for_bit(data, tmp_path, monkeypatch):
    off = run(tmp_path, monkeypatch, "off", None)
    on = run(tmp_path, monkeypatch, "on", None, *GUARD)
    assert spikes(on) == []
    assert [(r["loss"], r["grad_norm"]) for r in metric_rows(on)] == [(r["loss"], r["grad_norm"]) for r in metric_rows(off)]
    assert checkpoint.restore.first_difference(checkpoint_state(on, 10), checkpoint_state(off, 10)) is None


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_repeated_spikes_roll_back_past_their_data_and_the_record_stays(data, tmp_path, monkeypatch):
    run_dir = run(
        tmp_path, monkeypatch, "rollback", "spike:7", *GUARD, "train.spikes.lr_after=1", "train.spikes.rollback_after=1",
        "checkpoint.every=4", "train.log_every=1",
    )  # fmt: skip
    rows_ = metric_rows(run_dir)
    assert [r["step"] for r in rows_] == list(range(1, 11))  # steps 5-7 run again after the rollback
    (back,) = spikes(run_dir)  # step 7's row went with the undone steps; the rollback's carries it
    assert back["action"] == "rolled back" and back["step"] == 4
    assert [r["step"] for r in back["spikes"]] == [7] and back["spikes"][0]["origin"][0]["file"].endswith(".py")
    assert back["data_skipped_to"] == 14  # 7 steps of 2 samples read: step 5 goes on from sample 14
    assert all(r["loss"] < 100 for r in rows_)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_resumed_run_makes_the_same_decisions(data, tmp_path, monkeypatch):
    """Planted bug it catches: the window not restored (load_state_dict a no-op) leaves the
    resumed guard unable to judge step 8 (fewer than min_steps steps seen): no spike row."""
    straight = run(tmp_path, monkeypatch, "straight", "spike:8", *GUARD, "checkpoint.every=5")
    copy_until(straight, tmp_path / "resumed", 5)  # as a kill right after step 5's checkpoint leaves it
    resumed = run(tmp_path, monkeypatch, "resumed", "spike:8", *GUARD, "checkpoint.every=5")
    assert spikes(resumed) == spikes(straight) and len(spikes(straight)) == 1
    assert [(r["loss"], r["grad_norm"]) for r in metric_rows(resumed)] == [
        (r["loss"], r["grad_norm"]) for r in metric_rows(straight)
    ]


# -- poisoned documents ------------------------------------------------------------------------
POISON_STEPS = range(20, 101)  # judged (past min_steps=8) and within the run


def _poisoned_steps(data_dir, seed: int) -> dict[int, str] | None:
    """The steps that read a poisoned document at this seed (a sample of >= half a window of
    it), found from the tokens themselves (the stream's last two documents, between its last
    three EOS), not from the guard's provenance. None for a seed where a step reads less of
    one (a few tokens at a window's edge: spike or not, either is right), where one step
    reads both, or where either is missed or read before the guard judges (step 20)."""
    import numpy as np

    from scaletrain.data.loader import PackedTokens

    d = PackedTokens(data_dir, 64, seed)
    (shard,) = d._shards
    ends = np.flatnonzero(np.asarray(shard) == d.eos_id)
    spans = {"zz_greek.txt": (ends[-3] + 1, ends[-2]), "zz_one_token.txt": (ends[-2] + 1, ends[-1])}
    steps: dict[int, str] = {}
    for g in range(2 * (POISON_STEPS.stop - 1)):  # 2 samples a step
        start = d.sample_id(g)[1] * 64
        for name, (a, b) in spans.items():
            inside = min(b, start + 65) - max(a, start)
            if 0 < inside < 32 or (inside >= 32 and steps.get(g // 2 + 1, name) != name):
                return None
            if inside >= 32:
                steps[g // 2 + 1] = name
    if set(steps.values()) != set(spans) or min(steps) < POISON_STEPS.start:
        return None
    return steps


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_poisoned_documents_are_caught_and_named(tmp_path, monkeypatch):
    """A document of one token repeated and one of another script (random Greek words) in
    Python sources: each step that reads one is a loss spike (the one-token run's gradient
    too: its update held back), and its row names the file; no other step is judged a
    spike. Planted bug it catches: provenance naming the shard's first file (the document
    index not counted) fails the names."""
    import random

    from helpers.launch import check, scaletrain

    poison = tmp_path / "poison"
    poison.mkdir()
    (poison / "zz_one_token.txt").write_text("z" * 40000)
    rng = random.Random(0)
    words = ("".join(chr(rng.randint(0x3B1, 0x3C9)) for _ in range(rng.randint(2, 9))) for _ in range(40))
    (poison / "zz_greek.txt").write_text(" ".join(words))
    data_dir = tmp_path / "data"
    sources = [str(STDLIB / "json" / "*.py"), str(STDLIB / "email" / "*.py"), str(poison / "*.txt")]
    check(scaletrain(["data", "prepare", "--input", *sources, "--out", str(data_dir), "--vocab-size", "512"]))
    seed, where = next((s, w) for s in range(200) if (w := _poisoned_steps(data_dir, s)) is not None)
    monkeypatch.setattr(faults, "_ARMED", None)
    overrides = [
        *base_overrides(data_dir, tmp_path / "run", steps=POISON_STEPS.stop - 1), "train.micro_batch=2", f"train.seed={seed}",
        "train.spikes.enabled=true", "train.spikes.window=16", "train.spikes.min_steps=8", "train.spikes.rollback_after=0",
        # 8 robust sigmas: the poisoned steps' losses sit 9-15 above their windows' medians, the
        # clean steps of these runs up to 6.3 (a 6-sigma guard flags one of them at some seeds).
        "train.spikes.threshold=8",
    ]  # fmt: skip
    trainer.train(load_config([], overrides))
    found = {r["step"]: r for r in spikes(tmp_path / "run")}
    assert sorted(found) == sorted(where), (sorted(found), where)  # each poisoned step, and no other
    for step, name in where.items():
        row = found[step]
        assert row["metric"] == "loss" and any(o.get("file") == str(poison / name) for o in row["origin"]), row
        # held back exactly where the gradient norm spiked as well (at some seeds the one-token run's does)
        assert row["action"].startswith("update skipped") == ("grad_norm" in row.get("also", {}))
    # diagnose names them too
    from scaletrain.diagnose.findings import diagnose_run
    from scaletrain.diagnose.run import load_run

    (finding,) = [f for f in diagnose_run(load_run(tmp_path / "run")) if f.code == "spikes"]
    assert f"{len(where)} loss or gradient-norm spike" in finding.title and any("zz_greek.txt" in e for e in finding.evidence)


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_run_resumed_on_two_ranks_makes_the_same_decisions(data, tmp_path, monkeypatch):
    """N -> M: the window saved by one process, continued by two (ddp, micro-batch 1 each: the
    same global batch). Their losses may differ from one process's by summation order only
    (a few float32 roundings: ~1e-6 relative; measured equal here), far from any threshold:
    the same spike, step and action; the threshold, computed from the same saved window, equal."""
    from helpers.launch import check, train

    straight = run(tmp_path, monkeypatch, "straight", "spike:8", *GUARD, "checkpoint.every=5")
    copy_until(straight, tmp_path / "two", 5)
    args = [*base_overrides(tmp_path / "data", tmp_path / "two", steps=10), "train.micro_batch=1", *GUARD, "checkpoint.every=5"]
    check(train(args, nproc=2, env={"SCALETRAIN_KILL_AT": "spike:8"}))
    (one,), (two,) = spikes(straight), spikes(tmp_path / "two")
    assert (two["step"], two["metric"], two["action"], two["samples"]) == (
        one["step"],
        one["metric"],
        one["action"],
        one["samples"],
    )
    assert two["threshold"] == one["threshold"]  # from the window the checkpoint holds, read at step 5
    assert two["value"] == pytest.approx(one["value"], rel=1e-4)
