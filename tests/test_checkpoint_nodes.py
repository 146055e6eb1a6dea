"""Nodes that share no disk under run.dir (checkpoint/disks.py), drilled on one machine
with SCALETRAIN_NODE_DISKS (rank 1's checkpoints under run.dir/node1, as another machine's
own disk would hold them), checkpointing through the S3 server on loopback
(tests/s3_server.py): each node copies its own ranks' files, the store's copy is the
checkpoint, and a resume, a rollback and verify_on_start bring it back onto every disk."""

from __future__ import annotations

import json

import pytest

from helpers.launch import check, one_line_error, train
from helpers.runs import base_overrides, step_figures


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_nodes_that_share_no_disk_checkpoint_through_the_store(small_dataset, s3, tmp_path, strategy):
    """Two ranks as two nodes with disks of their own (the SCALETRAIN_NODE_DISKS drill: rank
    1's checkpoints under run.dir/node1): each copies the files its disk holds, the local
    parts go once copied, the Hugging Face export reads the store's copy; killed after step
    6, a second run on fresh disks brings the newest back onto both and goes on exactly as
    the run on one shared disk that never stopped."""
    common = [*base_overrides(small_dataset, tmp_path, steps=9)[:-1]]  # run.dir given below
    common += [f"parallel.strategy={strategy}", "eval.every=0", "checkpoint.every=3", "train.log_every=1"]
    straight = tmp_path / "straight"
    check(train([*common, f"run.dir={straight}"], nproc=2))
    url, apart = s3.url("ckpts"), {"SCALETRAIN_NODE_DISKS": "2"}
    first = tmp_path / "first"
    args = [*common, f"run.dir={first}", f"checkpoint.dir={url}", "checkpoint.hf_every=6"]
    killed = train(args, nproc=2, env={**apart, "SCALETRAIN_KILL_AT": "step:6"})  # after step 6 and its save, copy, export
    assert killed.returncode != 0
    assert (first / "node1" / "checkpoints").is_dir()  # rank 1 wrote its part on "its own disk"
    assert not list(first.glob("checkpoints/step_*")) + list(first.glob("node1/checkpoints/step_*"))
    assert s3.listing("ckpts") == ["hf", "step_3", "step_6"]
    fs = s3.fs()
    for step in (3, 6):  # the store's copy is whole: every file its manifest names, with its size
        there = f"{s3.bucket}/ckpts/step_{step}"
        files = json.loads(fs.cat_file(f"{there}/COMPLETE"))["files"]
        assert any(f.startswith("rng_rank1") for f in files) and any(f.startswith("rng_rank0") for f in files)
        assert {rel: fs.size(f"{there}/{rel}") for rel in files} == {rel: size for rel, (size, _) in files.items()}
    assert (first / "hf" / "step_6" / "model.safetensors.index.json").is_file()
    second = tmp_path / "second"
    proc = check(train([*common, f"run.dir={second}", f"checkpoint.dir={url}"], nproc=2, env=apart))
    assert f"resume: step 6 brought back from {url}" in proc.stdout
    assert step_figures(first) + step_figures(second) == step_figures(straight) and len(step_figures(straight)) == 9
    assert not list(second.glob("checkpoints/step_*")) + list(second.glob("node1/checkpoints/step_*"))
    assert s3.listing("ckpts")[-1] == "step_9"


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_rollback_and_verify_on_start_on_nodes_that_share_no_disk_go_through_the_store(small_dataset, s3, tmp_path):
    """checkpoint.verify_on_start's scratch checkpoint and a rollback's newest checkpoint
    come back from the store onto each node's disk: the run equals the same run on one
    shared disk (a NaN at step 5, rolled back to step 3)."""
    common = [
        "parallel.strategy=fsdp", "eval.every=0", "checkpoint.every=3", "train.log_every=1", "checkpoint.verify_on_start=true",
        "train.nonfinite=rollback", "train.nonfinite_patience=1",
    ]  # fmt: skip
    nan = {"SCALETRAIN_KILL_AT": "nan:5"}
    shared = tmp_path / "shared"
    check(train([*base_overrides(small_dataset, shared, steps=6), *common], nproc=2, env=nan))
    apart = tmp_path / "apart"
    args = [*base_overrides(small_dataset, apart, steps=6), *common, f"checkpoint.dir={s3.url('ckpts')}"]
    proc = check(train(args, nproc=2, env={**nan, "SCALETRAIN_NODE_DISKS": "2"}))
    assert "verify_on_start saved and reloaded step 1: every tensor came back exactly" in proc.stdout
    assert "rolled back to step 3" in proc.stdout and "resume: step 3 brought back" in proc.stdout
    assert step_figures(apart) == step_figures(shared) and len(step_figures(apart)) == 6
    assert s3.listing("ckpts") == ["step_3", "step_6"]  # the scratch checkpoint gone from the store


@pytest.mark.e2e
def test_nodes_that_share_no_disk_without_a_store_are_one_line(small_dataset, tmp_path):
    proc = train([*base_overrides(small_dataset, tmp_path / "run", steps=1)], nproc=2, env={"SCALETRAIN_NODE_DISKS": "2"})
    one_line_error(
        proc,
        "ranks 1 do not see the files rank 0 writes under run.dir=",
        "accepted: a run.dir on a disk every node shares, or checkpoint.dir on object storage",
    )
