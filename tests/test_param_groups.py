"""train.param_groups (optim/optimizers.py): parameters matched by name get their own learning
rate multiplier and weight decay in the engine's optimizer, on every engine, and say so."""

from __future__ import annotations

import pytest

from scaletrain.config import load_config
from scaletrain.diagnose import diagnose, write_report
from scaletrain.errors import UserError
from scaletrain.telemetry import read_metrics

from helpers.launch import check, probe, train
from helpers.runs import base_overrides

GROUPS = (
    'train.param_groups=[{match: ["tok_embeddings.*"], lr: 0.5, weight_decay: 0.0}, {match: ["*.attention_norm.*"], lr: 2.0}]'
)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_each_group_steps_at_its_multiple_of_the_schedule_on_every_engine(tmp_path):
    # One step at lr 1e-2 on 2 ranks, then each engine's neutral state (Engine.state_dict):
    # the learning rate and weight decay its optimizer holds for each parameter.
    ranks = probe("param_groups", ["ddp", "fsdp", "zero2", "zero3"], tmp_path, nproc=2)
    for strategy, got in ranks[0].items():
        assert got["tok_embeddings.weight"] == [pytest.approx(0.5e-2), 0.0], strategy  # the entry's decay, not 0.1
        assert got["layers.0.attention_norm.weight"] == [pytest.approx(2e-2), 0.0], strategy  # 1-D: no decay unless told
        assert got["layers.0.attention.wq.weight"] == [pytest.approx(1e-2), pytest.approx(0.1)], strategy  # the defaults
        assert got["layers.0.ffn_norm.weight"] == [pytest.approx(1e-2), 0.0], strategy
    assert ranks[0] == ranks[1]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_groups_are_said_at_the_start_their_rates_logged_and_plotted(small_dataset, tmp_path):
    run = tmp_path / "run"
    out = check(train([*base_overrides(small_dataset, run, steps=4), "train.log_every=2", GROUPS])).stdout
    # The two default groups, then each entry's (the embedding, a matrix; the norms, 1-D).
    said = [line for line in out.splitlines() if line.startswith("optimizer group")]
    assert len(said) == 4 and "lr x 0.5, weight_decay 0" in said[2] and "lr x 2, weight_decay 0" in said[3], said
    assert "lr x 1, weight_decay 0.1" in said[0] and "lr x 1, weight_decay 0" in said[1]
    # Each interval row: every group's rate at its last step, the schedule's x the multiplier
    # (warmup over 2 steps, then cosine: a different rate at steps 2 and 4).
    lr = {r["step"]: r["lr"] for r in read_metrics(run / "metrics.jsonl")}
    intervals = [r for r in read_metrics(run / "metrics.jsonl", events=True) if r.get("event") == "interval"]
    assert [r["step"] for r in intervals] == [2, 4] and lr[2] != lr[4]
    for r in intervals:
        assert [(g["group"], g["lr_scale"]) for g in r["lr_groups"]] == [(0, 1.0), (1, 1.0), (2, 0.5), (3, 2.0)]
        assert [g["lr"] for g in r["lr_groups"]] == pytest.approx([lr[r["step"]] * s for s in (1, 1, 0.5, 2)], rel=1e-6)
    # diagnose's report plots them beside the schedule, labelled as the start printed them.
    page = write_report(run, diagnose(run)).read_text()
    plot = page[page.index('id="plot-lr"') :].split("</figure>")[0]
    assert "<svg" in plot and "group 2 (lr x 0.5)" in plot and "group 3 (lr x 2)" in plot


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_pattern_that_matches_nothing_is_one_line(small_dataset, tmp_path):
    bad = 'train.param_groups=[{match: ["embeddings.*"], lr: 0.1}]'
    proc = train([*base_overrides(small_dataset, tmp_path / "bad", steps=1), bad])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "train.param_groups[0].match pattern 'embeddings.*' matches no trainable parameter; accepted: glob patterns" in (
        proc.stderr
    )


@pytest.mark.unit
def test_an_entry_without_a_pattern_or_with_a_bad_multiplier_is_refused():
    with pytest.raises(UserError, match="param_groups"):
        load_config([], ["train.param_groups=[{match: [], lr: 0.5}]"])
    with pytest.raises(UserError, match="param_groups"):
        load_config([], ['train.param_groups=[{match: ["*"], lr: 0}]'])


@pytest.mark.unit
def test_the_plan_says_the_groups_change_none_of_its_terms():
    """A parameter keeps the same state at any learning rate or decay: the plan with entries
    is the plan without them, and says so."""
    from scaletrain.planning import make_plan, planning_spec
    from scaletrain.planning.hardware import gpu

    plans = []
    for extra in ([], [GROUPS]):
        cfg = load_config([], ["model.preset=1b", "data.seq_len=2048", "precision=bf16", *extra])
        plans.append(make_plan(cfg, planning_spec(cfg), 8, 1, gpu("h100", "80GiB")))
    plain, grouped = plans
    assert [(c.setup, c.memory, c.step_time, c.comm_bytes) for c in grouped.candidates] == [
        (c.setup, c.memory, c.step_time, c.comm_bytes) for c in plain.candidates
    ]
    (said,) = [n for n in grouped.notes if n.startswith("train.param_groups")]
    assert said.startswith("train.param_groups: 2 entries of learning-rate multipliers") and not any(
        n.startswith("train.param_groups") for n in plain.notes
    )
