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


@pytest.mark.unit
@pytest.mark.parametrize("setting", ["train.compile=true", "train.float8=true"])
def test_auto_with_compile_or_float8_chooses_among_the_layouts_that_run_them(setting):
    """`parallel.strategy=auto` beside train.compile or train.float8 (both refused with auto
    until 2026-12-01): the config accepts it, and the planner's candidates are exactly the
    layouts the config would accept with that setting: re-validating each as the trainer
    does after the choice (training/preflight.py) refuses none."""
    from dataclasses import asdict, replace

    from scaletrain.config import load_config
    from scaletrain.errors import UserError
    from scaletrain.models import model_spec
    from scaletrain.planning.hardware import gpu
    from scaletrain.planning.planner import make_plan, setups_for

    # A mixture of experts at a length that offers context parallel: the candidates then span
    # ep, both cp designs, pipelines and every strategy, which compile and float8 each narrow.
    common = ["model.preset=tiny-moe", "model.vocab_size=512", "data.seq_len=32768", "precision=bf16", "train.micro_batch=1"]
    plain = load_config([], [*common, "parallel.strategy=auto"])
    cfg = load_config([], [*common, "parallel.strategy=auto", setting])
    model = model_spec(cfg, None)
    every = setups_for(plain, 16, 2, True, model)
    kept = [replace(s, float8=False) for s in setups_for(cfg, 16, 2, True, model)]  # the layouts, as `every` holds them
    assert 0 < len(kept) < len(every) and set(kept) < set(every)  # narrowed, not emptied
    for s in every:
        layout = [
            f"parallel.strategy={s.strategy}",
            f"parallel.tp={s.tp}",
            f"parallel.pp={s.pp}",
            f"parallel.pp_schedule={s.pp_schedule}",
            f"parallel.cp={s.cp}",
            f"parallel.cp_mode={s.cp_mode}",
            f"parallel.ep={s.ep}",
            f"parallel.offload_params={s.offload_params}",
        ]
        try:
            load_config([], [*common, *layout, setting])
            accepted = True
        except UserError:
            accepted = False
        assert accepted == (s in kept), (asdict(s) | {"teacher": None}, setting)
    # And the plan chooses one of them (an H100 node pair: datasheet rates, nothing replayed).
    chosen = make_plan(cfg, model, 16, 2, gpu("h100", None)).chosen
    assert chosen is not None and replace(chosen.setup, float8=False) in kept
