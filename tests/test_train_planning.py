"""The planner inside `train`: strategy auto is resolved before allocation and recorded;
opt-in LR scaling with the effective batch is applied and reported."""

from __future__ import annotations

import math

import pytest
import yaml

from helpers.launch import check, train
from helpers.runs import base_overrides, metric_rows, run_info


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_strategy_auto_is_resolved_and_recorded(small_dataset, tmp_path):
    run = tmp_path / "auto"
    proc = check(train([*base_overrides(small_dataset, run, steps=2), "parallel.strategy=auto"], nproc=2))
    resolved = yaml.safe_load((run / "config.yaml").read_text())["parallel"]
    assert resolved["strategy"] in ("ddp", "fsdp", "zero1", "zero2", "zero3")
    assert "chosen" in resolved["auto_choice"]
    assert f"parallel.strategy=auto -> {resolved['strategy']}" in proc.stdout
    assert "plan: predicted peak" in proc.stdout
    # What ran is what the resolved config says.
    assert (run_info(run)["engine"], run_info(run)["world_size"]) == (resolved["strategy"], 2)


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rule", ["linear", "sqrt"])
def test_lr_scaling_with_the_global_batch(small_dataset, tmp_path, rule):
    run = tmp_path / rule
    args = [
        *base_overrides(small_dataset, run, steps=4),
        "train.warmup_steps=2",
        "train.micro_batch=4",
        "train.grad_accum=2",
        "train.lr=0.001",
        f"train.lr_scaling={rule}",
        "train.lr_base_batch=2",
    ]
    proc = check(train(args))
    expected_peak = 0.001 * (4 if rule == "linear" else math.sqrt(4))  # global batch 8 vs 2
    rows = metric_rows(run)
    assert rows[1]["lr"] == pytest.approx(expected_peak)  # end of warmup = the peak
    assert f"-> {expected_peak:g} at the global batch of 8" in proc.stdout
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["lr"] == 0.001  # the user's value stays
