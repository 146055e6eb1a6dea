"""Acceptance: DDP == one process, accumulation == larger batch, bit-exact resume after a kill."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from scaletrain import checkpoint
from train_helpers import base_overrides, check, final_weights, losses, run_scaletrain


@pytest.fixture(scope="module")
def prepared(small_dataset):
    return small_dataset


def assert_weights_close(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


@pytest.mark.timeout(300)
def test_ddp_world_2_matches_one_process_on_the_same_global_batch(prepared, tmp_path):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    check(run_scaletrain(["train", *base_overrides(prepared, single), "train.micro_batch=4"]))
    proc = check(run_scaletrain(["train", *base_overrides(prepared, ddp), "train.micro_batch=2"], nproc=2))
    assert "world 2 x cpu (gloo)" in proc.stdout
    a, b = losses(single), losses(ddp)
    assert len(a) == len(b) == 10
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert a[-1] < a[0]  # it trained, not just agreed
    # Replicas hold identical weights; the checkpoint of world 2 matches the single process.
    assert_weights_close(final_weights(ddp, 10), final_weights(single, 10), rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(300)
def test_accumulation_4_x_2_equals_one_batch_of_8(prepared, tmp_path):
    accum, big = tmp_path / "accum", tmp_path / "big"
    check(run_scaletrain(["train", *base_overrides(prepared, accum), "train.micro_batch=2", "train.grad_accum=4"]))
    check(run_scaletrain(["train", *base_overrides(prepared, big), "train.micro_batch=8", "train.grad_accum=1"]))
    np.testing.assert_allclose(losses(accum), losses(big), rtol=1e-5)
    # Summation order differs (4 partial sums vs one); Adam divides by sqrt(v), which lifts
    # ~1e-9 gradient noise on near-zero entries to ~1e-6 in the weights. One step moves ~lr=3e-3.
    assert_weights_close(final_weights(accum, 10), final_weights(big, 10), rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(300)
def test_ddp_with_accumulation_matches_one_process(prepared, tmp_path):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    check(run_scaletrain(["train", *base_overrides(prepared, single, steps=6), "train.micro_batch=4", "train.grad_accum=2"]))
    check(run_scaletrain(["train", *base_overrides(prepared, ddp, steps=6), "train.micro_batch=2", "train.grad_accum=2"], nproc=2))
    np.testing.assert_allclose(losses(ddp), losses(single), rtol=1e-5)


@pytest.mark.timeout(300)
def test_killed_run_resumes_bit_exactly(prepared, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    common = ["train.micro_batch=4", "checkpoint.every=10"]
    check(run_scaletrain(["train", *base_overrides(prepared, straight, steps=20), *common]))

    proc = run_scaletrain(["train", *base_overrides(prepared, killed, steps=20), *common], env={"SCALETRAIN_KILL_AT_STEP": "13"})
    assert proc.returncode == -9, proc.stderr  # SIGKILL: no handler, no chance to save
    assert [s for s, _ in checkpoint.complete_checkpoints(killed / "checkpoints")] == [10]

    proc = check(run_scaletrain(["train", *base_overrides(prepared, killed, steps=20), *common]))
    assert "resuming from" in proc.stdout and "step_10" in proc.stdout
    assert losses(killed) == losses(straight)  # exact float equality, all 20 steps
    a, b = final_weights(killed, 20), final_weights(straight, 20)
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads((killed / "checkpoints" / "step_20" / "trainer.json").read_text())
    assert state["data_position"] == 20 * 4


@pytest.mark.timeout(300)
def test_resume_skips_a_checkpoint_without_its_marker(prepared, tmp_path):
    run = tmp_path / "run"
    args = ["train", *base_overrides(prepared, run, steps=12), "train.micro_batch=4", "checkpoint.every=4", "checkpoint.keep=5"]
    check(run_scaletrain(args))
    reference = losses(run)
    (run / "checkpoints" / "step_12" / checkpoint.MARKER).unlink()  # as if killed mid-save
    (run / "checkpoints" / "step_8" / checkpoint.MARKER).unlink()
    proc = check(run_scaletrain(args))
    assert "resuming from" in proc.stdout and "step_4" in proc.stdout
    assert losses(run) == reference  # steps 5..12 redone identically, no duplicate rows
    assert checkpoint.is_complete(run / "checkpoints" / "step_12")


@pytest.mark.timeout(300)
def test_resume_never_refuses_to_overwrite_checkpoints(prepared, tmp_path):
    run = tmp_path / "run"
    check(run_scaletrain(["train", *base_overrides(prepared, run, steps=2)]))
    proc = run_scaletrain(["train", *base_overrides(prepared, run, steps=2), "train.resume=never"])
    assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr and "Traceback" not in proc.stderr
    assert checkpoint.is_complete(run / "checkpoints" / "step_2")  # nothing was lost


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(prepared, tmp_path, precision):
    run = tmp_path / precision
    check(run_scaletrain(["train", *base_overrides(prepared, run, steps=12), "train.micro_batch=4", f"precision={precision}"]))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert np.mean([r["loss"] for r in rows[-3:]]) < rows[0]["loss"] - 0.3
    if precision == "fp16":
        assert all(r["loss_scale"] > 0 for r in rows)  # dynamic loss scale is logged each step
