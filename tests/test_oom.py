"""Out of memory, survived (resilience/oom.py): a run that meets torch.OutOfMemoryError continues at the
next smaller micro-batch with the same global batch, from the newest checkpoint, and
computes what a run started at that micro-batch computes.

The error is planted with SCALETRAIN_KILL_AT=oom:STEP@RANK (resilience/faults.py): the rank's first
forward of that step raises torch.OutOfMemoryError, as a device out of memory would.
Checkpoints every 2 steps, the error at step 3: the run goes on from step 2's checkpoint.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from scaletrain.telemetry import read_metrics

from helpers.launch import check, one_line_error, scaletrain, train
from helpers.numerics import GRAD_NORM_RTOL, LOSS_RTOL
from helpers.runs import base_overrides, metric_rows, run_info

STEPS = 5


def _overrides(data, run, *extra: str) -> list[str]:
    return [*base_overrides(data, run, steps=STEPS), "checkpoint.every=2", "train.log_every=1", *extra]


def _assert_same_numbers(run, straight) -> None:
    """Accumulation over 2 micro-batches equals one twice the size up to summation order:
    the standing equivalence tolerances (helpers/numerics.py, where they are derived) hold."""
    got, want = metric_rows(run), metric_rows(straight)
    assert len(got) == len(want) == STEPS
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=LOSS_RTOL, err_msg="loss per step")
    np.testing.assert_allclose(
        [r["grad_norm"] for r in got], [r["grad_norm"] for r in want], rtol=GRAD_NORM_RTOL, err_msg="grad norm per step"
    )


def _oom_events(run) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl", events=True) if r.get("event") == "oom"]


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["ddp", "fsdp", "zero2"])
def test_an_oom_on_one_rank_restarts_every_rank_at_half_the_micro_batch_with_the_same_numbers(small_dataset, tmp_path, engine):
    run, straight = tmp_path / "oom", tmp_path / "straight"
    strategy = f"parallel.strategy={engine}"
    proc = check(
        train(_overrides(small_dataset, run, strategy, "train.micro_batch=4"), nproc=2, env={"SCALETRAIN_KILL_AT": "oom:3@1"})
    )
    check(train(_overrides(small_dataset, straight, strategy, "train.micro_batch=2", "train.grad_accum=2"), nproc=2))
    _assert_same_numbers(run, straight)
    # The recovery path, named; the restart went on from step 2's checkpoint at micro-batch 2.
    assert "out of memory on rank 1 in forward at step 3 (train.micro_batch=4)" in proc.stderr
    assert "every rank restarted" in proc.stderr and "relaunch 1" in proc.stderr
    assert "train.micro_batch 4 -> 2, train.grad_accum 1 -> 2" in proc.stdout
    assert f"resuming from {run / 'checkpoints' / 'step_2'}" in proc.stdout
    assert "Traceback" not in proc.stderr  # the rank whose collective failed left quietly too
    resolved = yaml.safe_load((run / "config.yaml").read_text())["train"]
    assert (resolved["micro_batch"], resolved["grad_accum"], resolved["global_batch"]) == (2, 2, 8)
    assert run_info(run)["batch"]["micro_batch"] == 2
    (event,) = _oom_events(run)
    assert {k: event[k] for k in ("step", "rank", "phase", "micro_batch", "next_micro_batch", "path")} == {
        "step": 3, "rank": 1, "phase": "forward", "micro_batch": 4, "next_micro_batch": 2, "path": "restart",
    }  # fmt: skip


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_a_mixture_of_experts_survives_an_oom_with_the_numbers_of_a_run_that_met_none(small_dataset, tmp_path):
    # The balance term counted per sequence (model.moe.balance=sequence_aux, the default) makes a
    # MoE run's numbers depend on the global batch only: halving the micro-batch mid-run changes
    # nothing, so the run that met the error equals one that never did, at micro-batch 4 throughout.
    run, straight = tmp_path / "oom", tmp_path / "straight"
    moe = ("model.preset=tiny-moe", "parallel.strategy=fsdp", "parallel.ep=2", "train.micro_batch=4")
    proc = check(train(_overrides(small_dataset, run, *moe), nproc=2, env={"SCALETRAIN_KILL_AT": "oom:3@1"}))
    check(train(_overrides(small_dataset, straight, *moe), nproc=2))
    _assert_same_numbers(run, straight)
    assert "train.micro_batch 4 -> 2, train.grad_accum 1 -> 2" in proc.stdout
    assert "model.moe.balance=aux counts" not in proc.stdout  # nothing to warn of: the numbers keep


@pytest.mark.e2e
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_one_process_recovers_inside_itself_and_remembers_the_micro_batch(small_dataset, tmp_path):
    run, straight = tmp_path / "oom", tmp_path / "straight"
    proc = check(train(_overrides(small_dataset, run, "train.micro_batch=8"), env={"SCALETRAIN_KILL_AT": "oom:3"}))
    check(train(_overrides(small_dataset, straight, "train.micro_batch=4", "train.grad_accum=2")))
    _assert_same_numbers(run, straight)
    assert "continuing at train.micro_batch=4, train.grad_accum=2 (global batch 8)" in proc.stderr
    assert "inside this process" in proc.stderr
    (event,) = _oom_events(run)
    assert event["path"] == "in-process" and event["next_micro_batch"] == 4
    # The next start of the run keeps the smaller micro-batch (no error planted this time).
    again = check(train(_overrides(small_dataset, run, "train.micro_batch=8", f"train.steps={STEPS + 1}")))
    assert "oom: train.micro_batch 8 -> 4" in again.stdout
    assert len(_oom_events(run)) == 1  # logged once, not at every start
    # diagnose names it, with what to set from the start.
    found = json.loads(check(scaletrain(["diagnose", str(run), "--json", "--no-html"])).stdout)
    oom = [f for f in found if f["code"] == "out_of_memory"]
    assert oom and "micro-batch 4" in oom[0]["title"] and "train.micro_batch to 4" in oom[0]["advice"]


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_an_oom_at_micro_batch_1_stops_with_one_line_naming_what_would_help(small_dataset, tmp_path):
    run = tmp_path / "oom"
    proc = train(_overrides(small_dataset, run, "train.micro_batch=1", "train.grad_accum=2"), env={"SCALETRAIN_KILL_AT": "oom:2"})
    one_line_error(proc, "out of memory on rank 0 in forward at step 2", "smallest micro-batch", "activation_checkpointing")
    assert not (run / "oom").exists()  # nothing to remember: no smaller micro-batch


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_micro_batch_auto_resolves_to_a_number_in_the_log_config_and_run_json(small_dataset, tmp_path):
    run = tmp_path / "auto"
    proc = check(train([*base_overrides(small_dataset, run, steps=2), "train.micro_batch=auto", "train.global_batch=8"]))
    resolved = yaml.safe_load((run / "config.yaml").read_text())["train"]
    # The host's memory holds all 8 sequences of this tiny model at once.
    assert (resolved["micro_batch"], resolved["grad_accum"], resolved["global_batch"]) == (8, 1, 8)
    assert "train.micro_batch=auto -> 8" in resolved["batch_choice"]
    assert "plan: train.micro_batch=auto -> 8" in proc.stdout
    assert run_info(run)["batch"] == {"global_batch": 8, "micro_batch": 8, "grad_accum": 1, "choice": resolved["batch_choice"]}
