"""Crash safety: a checkpoint damaged after its save (truncated, emptied, missing or
overwritten file, unreadable marker) is found from the manifest its COMPLETE marker holds,
reported in one line naming what is wrong, and skipped for the previous whole one; pruning
never deletes the last whole checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch

from scaletrain import checkpoint
from scaletrain.checkpoint.restore import first_difference
from scaletrain.launch.distributed import ALONE

from helpers.launch import check, train
from helpers.numerics import assert_bit_exact
from helpers.runs import base_overrides, copy_until, eval_overrides, run_info, trainer_state


def save(root, step):
    def write_state(d):
        d.mkdir(parents=True)
        torch.save({"w": torch.full((256,), float(step))}, d / "shard0.pt")

    path = checkpoint.step_dir(root, step)
    checkpoint.save_checkpoint(path, ALONE, write_state, trainer_state(step=step), {"config.yaml": "x: 1\n"})
    return path


def truncate(path):
    f = path / "state" / "shard0.pt"
    f.write_bytes(f.read_bytes()[:100])


def empty(path):
    (path / "state" / "shard0.pt").write_bytes(b"")


def remove(path):
    (path / "state" / "shard0.pt").unlink()


def garbage(path):  # same size, other bytes: only the checksum tells
    f = path / "state" / "shard0.pt"
    f.write_bytes(os.urandom(f.stat().st_size))


def bad_marker(path):
    (path / checkpoint.MARKER).write_text("{not json")


DAMAGE = {
    "truncated": (truncate, "state/shard0.pt is 100 bytes"),
    "zero-byte": (empty, "state/shard0.pt is 0 bytes"),
    "missing": (remove, "state/shard0.pt is missing"),
    "garbage": (garbage, "state/shard0.pt does not match its checksum"),
    "unreadable marker": (bad_marker, "COMPLETE marker is unreadable"),
}


@pytest.mark.unit
@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_checkpoint_is_reported_and_skipped(tmp_path, kind):
    damage, words = DAMAGE[kind]
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    assert checkpoint.find_problem(newest, ALONE) is None
    assert checkpoint.latest_valid(tmp_path, ALONE, print) == newest
    damage(newest)
    lines = []
    assert checkpoint.latest_valid(tmp_path, ALONE, lines.append) == tmp_path / "step_1"
    assert len(lines) == 1 and "skipping" in lines[0] and str(newest) in lines[0] and words in lines[0], lines


@pytest.mark.unit
def test_prune_never_deletes_the_last_whole_checkpoint(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    truncate(save(tmp_path, 3))  # newest complete, but damaged: it does not count as kept
    checkpoint.prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]


@pytest.mark.unit
def test_manifest_records_every_file_with_size_and_checksum(tmp_path):
    path = save(tmp_path, 4)
    files = json.loads((path / checkpoint.MARKER).read_text())["files"]
    assert sorted(files) == ["config.yaml", "rng_rank0.pt", "state/shard0.pt", "trainer.json"]
    assert all(size == (path / rel).stat().st_size for rel, (size, _) in files.items())


@pytest.mark.unit
def test_verification_names_the_first_tensor_that_differs():
    state = {"model": {"a": torch.ones(3)}, "optim": {"state.a.exp_avg": torch.zeros(3), "state.a.step": torch.tensor(5.0)}}
    same = {"model": {"a": torch.ones(3)}, "optim": {"state.a.exp_avg": torch.zeros(3), "state.a.step": torch.tensor(5.0)}}
    assert first_difference(same, state) is None
    moved = {**same, "optim": {**same["optim"], "state.a.exp_avg": torch.tensor([0.0, 1e-30, 0.0])}}
    assert "optim state.a.exp_avg differs in 1 of 3 elements" in first_difference(moved, state)
    restarted = {**same, "optim": {**same["optim"], "state.a.step": torch.tensor(0.0)}}
    assert "optimizer step of a is 0" in first_difference(restarted, state)
    assert "model a is missing" in first_difference({"model": {}, "optim": same["optim"]}, state)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_resume_skips_a_damaged_newest_checkpoint(small_dataset, reference_run, tmp_path):
    run = tmp_path / "run"
    copy_until(reference_run, run, step=5)
    copy_until_10 = reference_run / "checkpoints" / "step_10"
    import shutil

    shutil.copytree(copy_until_10, run / "checkpoints" / "step_10")
    shard = next((run / "checkpoints" / "step_10" / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a disk that filled up
    proc = check(
        train([*base_overrides(small_dataset, run), "train.micro_batch=4", "checkpoint.every=5", *eval_overrides(small_dataset)])
    )
    skipped = [line for line in proc.stdout.splitlines() if "skipping" in line]
    assert len(skipped) == 1 and "step_10" in skipped[0] and "bytes" in skipped[0], proc.stdout[-2000:]
    assert run_info(run)["resumed_from"].endswith("step_5")
    assert_bit_exact(run, reference_run, 10)
