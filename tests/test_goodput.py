"""Goodput under failures (`scaletrain plan --mtbf-hours`, planning/goodput.py): the formulas of
docs/fault-tolerance.md against numbers worked by hand, the choice in both regimes, and
the CLI's lines, JSON and one-line errors."""

from __future__ import annotations

import json
import math

import pytest

from scaletrain.cli import main
from scaletrain.planning.goodput import TORCHFT_TIMEOUT_S, Failures, daly_interval_s, estimate_goodput

pytestmark = pytest.mark.unit

# 1000 devices of 1000 h each: the job fails every hour (3600 s).
CASE = Failures(
    devices=1000, mtbf_hours=1000, step_s=1.0, every_steps=100, save_s=10.0, restart_s=300.0, groups=10, transfer_s=20.0
)


def test_goodput_formulas_worked_by_hand():
    g = estimate_goodput(CASE)
    assert g.job_mtbf_h == pytest.approx(1.0)
    # Checkpoint-and-restart at 100 steps (100 s) + a 10 s save: 100/110 of the time trains,
    # and each failure (every 3600 s) loses the restart (300 s) and half a cycle (55 s).
    assert g.restart == pytest.approx(100 / 110 * (1 - (300 + 55) / 3600), rel=1e-12)
    # Daly: sqrt(2 x 10 x 3600) - 10 = 258.3 s, 258 steps of 1 s.
    assert daly_interval_s(CASE) == pytest.approx(math.sqrt(72000) - 10)
    assert g.optimal_steps == 258
    assert g.restart_optimal == pytest.approx(258 / 268 * (1 - (300 + 134) / 3600), rel=1e-12)
    # Replica groups: a failure costs one step, torchft's 60 s timeout and a tenth of the
    # job for the restart and the 20 s state transfer.
    lost = 1 + TORCHFT_TIMEOUT_S + (300 + 20) / 10
    assert g.replica_groups == pytest.approx(100 / 110 * (1 - lost / 3600), rel=1e-12)
    assert g.replica_groups_optimal == pytest.approx(258 / 268 * (1 - lost / 3600), rel=1e-12)
    assert g.choice == "replica_groups" and "9.1 points more" in g.why  # 93.78% against 84.66%


def test_rare_failures_keep_checkpoint_and_restart():
    rare = Failures(**{**CASE.__dict__, "mtbf_hours": 10_000_000})  # the job fails every 10,000 h
    g = estimate_goodput(rare)
    assert g.choice == "restart" and g.replica_groups_optimal - g.restart_optimal < 0.005
    assert g.optimal_steps > CASE.every_steps  # rarer failures: rarer checkpoints


def _plan(capsys, *extra: str) -> tuple[int, str, str]:
    args = ["plan", "model.preset=70b", "data.seq_len=4096", "precision=bf16", "train.micro_batch=1"]
    code = main([*args, "--gpus-per-node", "8", "--nodes", "16", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_both_goodputs_and_a_choice(capsys):
    code, out, _ = _plan(capsys, "--mtbf-hours", "2000")
    assert code == 0
    text = " ".join(out.split())  # the table wraps long lines
    assert "failures (--mtbf-hours, the job fails every 15.6 h): checkpoint-and-restart at checkpoint.every=100: goodput" in text
    assert "at Young/Daly's optimal interval, checkpoint.every=" in text and "replica groups (16 groups, torchft)" in text
    assert "choose replica groups: at the same checkpoints replica groups keep" in text
    code, out, _ = _plan(capsys, "--mtbf-hours", "2000", "--json")
    g = json.loads(out)["goodput"]
    assert code == 0 and g["groups"] == 16 and g["choice"] == "replica_groups" and 0 < g["restart"] < g["replica_groups"] < 1


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--mtbf-hours", "0"], "--mtbf-hours 0.0 is invalid; accepted: a finite number of hours > 0"),
        (["--mtbf-hours", "nan"], "--mtbf-hours nan is invalid"),
        (["--mtbf-hours", "10", "--restart-minutes", "-1"], "--restart-minutes -1.0 is invalid; accepted: a finite number >= 0"),
        (
            ["--mtbf-hours", "10", "--ft-groups", "3"],
            "--ft-groups 3 is invalid; accepted: 2 or more replica groups that divide the 128",
        ),
    ],
)
def test_bad_goodput_flags_are_one_line(capsys, flags, says):
    code, _, err = _plan(capsys, *flags)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and says in lines[0], err
