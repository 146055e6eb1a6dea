"""Acceptance: DDP == one process, accumulation == a larger batch, and a run killed at any
moment (after a step, inside a checkpoint save, inside pruning, inside a metrics write; at
world 1 and 2; with fp16 after the loss scale moved, in one process) resumes bit-exactly.

The straight runs are the session's shared references (conftest.py): one process at global
batch 4 and DDP at world 2, both checkpointing every 5 of 10 steps.
"""

from __future__ import annotations

import json

import pytest

from scaletrain import checkpoint

from helpers.launch import check, train
from helpers.numerics import assert_bit_exact, assert_same_training, assert_scale_moved
from helpers.runs import FP16_MOVING_SCALE, base_overrides, copy_until, eval_overrides, run_info


def completed(run) -> list[int]:
    return [s for s, _ in checkpoint.complete_checkpoints(run / "checkpoints")]


@pytest.mark.dist
@pytest.mark.equivalence
def test_ddp_world_2_matches_one_process_on_the_same_global_batch(reference_run, ddp2_run):
    info = run_info(ddp2_run)
    assert (info["engine"], info["world_size"], info["backend"], info["device"]) == ("ddp", 2, "gloo", "cpu")
    assert len(info["hosts"]) == 2 and info["versions"]["torch"].startswith("2.13")
    assert_same_training(ddp2_run, reference_run)


@pytest.mark.e2e
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_accumulation_4_x_1_equals_one_batch_of_4(small_dataset, reference_run, tmp_path):
    run = tmp_path / "accum"
    check(
        train([*base_overrides(small_dataset, run), "train.micro_batch=1", "train.grad_accum=4", *eval_overrides(small_dataset)])
    )
    assert_same_training(run, reference_run)


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_ddp_with_accumulation_matches_one_process(small_dataset, reference_run, tmp_path):
    run = tmp_path / "ddp"
    check(
        train(
            [*base_overrides(small_dataset, run), "train.micro_batch=1", "train.grad_accum=2", *eval_overrides(small_dataset)],
            nproc=2,
        )
    )
    assert_same_training(run, reference_run)


# point -> (extra overrides, complete checkpoints left by the kill, where the resume starts)
# A kill between two saves finds step_5 complete only if its asynchronous writing (a thread:
# checkpoint/manager.py's PendingSave) ended before the kill, which on a loaded machine it
# need not (CI saw step_5 without its marker at metrics:10): there the save is synchronous,
# so the kill meets a known state. save:10 and prune:6 are met after the next save has
# waited for the pending one, so they keep the asynchronous default.
SYNC = "checkpoint.async_save=false"
KILLS = {
    "step:7": ([SYNC], [5], 5),
    "save:10": ([], [5], 5),  # step_10 holds everything but its COMPLETE marker
    "metrics:10": ([SYNC], [5], 5),  # the flush before the save of step 10, cut mid-row
    # keep=1 prunes step_3 after saving step_6; killed with step_3's marker gone, files not.
    "prune:6": (["checkpoint.every=3", "checkpoint.keep=1"], [6], 6),
}


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", list(KILLS))
def test_killed_run_resumes_bit_exactly(small_dataset, reference_run, tmp_path, point):
    extra, left, resumed_at = KILLS[point]
    run = tmp_path / "killed"
    # Evaluated as the reference is: the evaluation of step 8 (at save:10 also step 10's),
    # written before the kill, goes with the steps after step_5 and is made again.
    args = [
        *base_overrides(small_dataset, run),
        "train.micro_batch=4",
        "checkpoint.every=5",
        *eval_overrides(small_dataset),
        *extra,
    ]
    proc = train(args, env={"SCALETRAIN_KILL_AT": point})
    assert proc.returncode == -9, proc.stderr[-3000:]  # SIGKILL: no handler, no chance to clean up
    assert completed(run) == left
    if point == "save:10":
        assert (run / "checkpoints" / "step_10" / "trainer.json").is_file()
    if point == "prune:6":
        assert (run / "checkpoints" / "step_3").is_dir() and not checkpoint.is_complete(run / "checkpoints" / "step_3")

    check(train(args))
    assert run_info(run)["resumed_from"].endswith(f"step_{resumed_at}")
    assert_bit_exact(run, reference_run, 10)  # exact float equality, every metric of all 10 steps
    state = json.loads((run / "checkpoints" / "step_10" / "trainer.json").read_text())
    assert state["data_position"] == 10 * 4
    if point == "prune:6":  # the half-deleted checkpoint went at the next prune
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_10"]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_killed_ddp_world_2_resumes_bit_exactly(small_dataset, ddp2_run, tmp_path):
    run = tmp_path / "killed"
    # Synchronous saves, as at step:7 above: the kill then finds step_5 complete on any machine.
    args = [
        *base_overrides(small_dataset, run),
        "train.micro_batch=2",
        "checkpoint.every=5",
        SYNC,
        *eval_overrides(small_dataset),
    ]
    proc = train(args, nproc=2, env={"SCALETRAIN_KILL_AT": "step:7"})
    assert proc.returncode == 1 and "failed with signal SIGKILL" in proc.stderr, proc.stderr[-3000:]
    assert completed(run) == [5]
    check(train(args, nproc=2))
    assert run_info(run)["resumed_from"].endswith("step_5")
    assert_bit_exact(run, ddp2_run, 10)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_fp16_ddp_resumes_bit_exactly_after_the_loss_scale_moved(small_dataset, tmp_path):
    # Continues from the straight run's step 5 (what a kill after step 7 leaves, without the
    # kill: the tests above kill for real). One process: the scaler's state (scale, growth
    # tracker) is each rank's own, saved and restored by the same code at any world size;
    # ZeRO-2's fp16 resume runs at world 2 (test_engine_deepspeed.py).
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["train.micro_batch=4", "checkpoint.every=5", *FP16_MOVING_SCALE]
    check(train([*base_overrides(small_dataset, straight), *common]))
    assert_scale_moved(straight)
    copy_until(straight, resumed, step=5)
    check(train([*base_overrides(small_dataset, resumed), *common]))
    assert_bit_exact(resumed, straight, 10)  # losses, loss_scale and skipped of every step
