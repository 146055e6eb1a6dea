"""checkpoint.dir as a URL (checkpoint/remote.py), against the S3 server on loopback
(tests/s3_server.py): checkpoints copied there (marker last, keep-k), and a run on a machine
that has none of them resumed from there at another world size, equal to the same resume
from local disk bit for bit; the newest-complete rule and the verification on resume hold
in the store as on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from s3_server import SECRET
from scaletrain.telemetry.metrics import read_metrics

from helpers.launch import check, one_line_error, train
from helpers.runs import base_overrides, step_figures


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_a_run_resumed_from_s3_at_another_world_size_equals_the_resume_from_disk(small_dataset, s3, tmp_path, strategy):
    common = [f"parallel.strategy={strategy}", "eval.every=0", "checkpoint.every=3", "checkpoint.keep=2", "train.log_every=1"]
    url = s3.url("ckpts")
    # On disk: 6 steps at world 2, then the same run.dir goes on to 9 steps at world 1.
    local = tmp_path / "local"
    check(train([*base_overrides(small_dataset, local, steps=6), *common], nproc=2))
    check(train([*base_overrides(small_dataset, local, steps=9), *common]))
    # To s3: the same 6 steps, checkpoints copied to the store; then a fresh run.dir (a
    # machine with none of them) goes on to 9 steps at world 1 from the store's newest.
    first = tmp_path / "first"
    check(train([*base_overrides(small_dataset, first, steps=6), *common, f"checkpoint.dir={url}"], nproc=2))
    fs = s3.fs()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{s3.bucket}/ckpts"))
    assert names == ["step_3", "step_6"]
    for step in (3, 6):  # every file of each local checkpoint, the marker among them
        here = sorted(
            p.relative_to(first / "checkpoints" / f"step_{step}").as_posix()
            for p in (first / "checkpoints" / f"step_{step}").rglob("*")
            if p.is_file()
        )
        there = sorted(p[len(f"{s3.bucket}/ckpts/step_{step}/") :] for p in fs.find(f"{s3.bucket}/ckpts/step_{step}"))
        assert here == there and "COMPLETE" in there
    second = tmp_path / "second"
    args = [*base_overrides(small_dataset, second, steps=9), *common, f"checkpoint.dir={url}", "checkpoint.hf_last=true"]
    proc = check(train(args))
    assert f"resume: step 6 brought back from {url}" in proc.stdout
    assert step_figures(second) == step_figures(local)[6:]
    # The last step's Hugging Face weights beside the checkpoints in the store, as on disk.
    hf = second / "hf" / "step_9"
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == {
        p.rsplit("/", 1)[-1]: fs.cat_file(p) for p in fs.find(f"{s3.bucket}/ckpts/hf/step_9")
    }
    # The credentials came from the environment: no file either run wrote holds the secret.
    written = [p for run in (first, second) for p in run.rglob("*") if p.is_file()]
    assert not [p for p in written if SECRET.encode() in p.read_bytes()]
    # keep=2 in the store too: step 3 gone once 9 is there.
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{s3.bucket}/ckpts")) == ["hf", "step_6", "step_9"]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_the_store_s_newest_complete_and_whole_checkpoint_is_the_one_resumed(small_dataset, s3, tmp_path):
    """A copy killed before its marker (the marker removed) is not a checkpoint; a damaged
    file (checked against the manifest after the download) is reported and the next older
    one taken."""
    common = ["eval.every=0", "checkpoint.every=2", "checkpoint.keep=3", f"checkpoint.dir={s3.url('ckpts')}"]
    check(train([*base_overrides(small_dataset, tmp_path / "first", steps=6), *common]))
    fs = s3.fs()
    fs.rm(f"{s3.bucket}/ckpts/step_6/COMPLETE")  # as if killed mid-copy
    state = sorted(p for p in fs.find(f"{s3.bucket}/ckpts/step_4") if "/state/" in p)[0]
    fs.pipe_file(state, b"\0" + fs.cat_file(state)[1:])  # one byte changed
    proc = check(train([*base_overrides(small_dataset, tmp_path / "second", steps=7), *common]))
    # The line that says the damaged one was skipped, naming it and why (the second run saves
    # its own step_4 later: "step_4" anywhere in the output would prove nothing).
    skipped = [line for line in proc.stdout.splitlines() if "resume: skipping" in line]
    assert len(skipped) == 1, proc.stdout[-3000:]
    assert f"{s3.url('ckpts')}/step_4: " in skipped[0] and "does not match its checksum" in skipped[0], skipped
    assert "resume: step 2 brought back" in proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "second" / "metrics.jsonl")] == [3, 4, 5, 6, 7]


@pytest.mark.e2e
def test_a_checkpoint_dir_that_is_not_a_url_or_not_there_and_a_run_dir_that_is_one_are_one_line(small_dataset, s3, tmp_path):
    proc = train([*base_overrides(small_dataset, tmp_path / "run", steps=1), f"checkpoint.dir={tmp_path / 'ckpts'}"])
    one_line_error(proc, "checkpoint.dir=", "is not a URL; accepted: a URL of object storage (s3://bucket/prefix)")
    proc = train([*base_overrides(small_dataset, tmp_path / "run", steps=1), "checkpoint.dir=s3://no-such-bucket/ckpts"])
    one_line_error(proc, "checkpoint.dir=s3://no-such-bucket/ckpts: its bucket 'no-such-bucket' does not exist")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # at start, before any step
    proc = train([*base_overrides(small_dataset, tmp_path / "run", steps=1), "run.dir=s3://bucket/run"])
    one_line_error(proc, "run.dir=s3://bucket/run is a URL, not a directory on this machine", "checkpoint.dir=<url>")
    assert not list(tmp_path.glob("s3*")) and not list(Path.cwd().glob("s3:*"))  # no directory named after it


@pytest.mark.unit
def test_a_copy_writes_its_marker_last_and_a_failed_one_none(tmp_path):
    from scaletrain.checkpoint.remote import CheckpointStore, StoreCopy
    from scaletrain.launch.distributed import ALONE

    local = tmp_path / "step_5"
    (local / "state").mkdir(parents=True)
    names = ["config.yaml", "state/__0_0.distcp", "trainer.json"]
    for name in names:
        (local / name).write_text(name)

    class Recording:
        protocol = "memory"

        def __init__(self, refuse: str = "") -> None:
            self.written: list[str] = []
            self.refuse = refuse

        def put_file(self, src: str, dst: str) -> None:
            if self.refuse and dst.endswith(self.refuse):
                raise PermissionError("Access Denied")  # not retried: one failure is the answer
            self.written.append(dst)

        def pipe_file(self, dst: str, data: bytes) -> None:
            self.written.append(dst)

    said: list[str] = []
    stores = [Recording(), Recording(refuse="trainer.json")]
    for fs in stores:
        copy = StoreCopy.__new__(StoreCopy)
        copy.store, copy.keep, copy.report = CheckpointStore.__new__(CheckpointStore), 2, said.append
        copy.store.url, copy.store.fs, copy.store.root = "s3://b/ckpts", fs, "b/ckpts"
        copy.store.prune = lambda keep: None  # type: ignore[method-assign]
        copy(local, ALONE, 5, names, "{}")
    whole, failed = stores
    assert whole.written == [f"b/ckpts/step_5/{n}" for n in names] + ["b/ckpts/step_5/COMPLETE"]
    assert "b/ckpts/step_5/COMPLETE" not in failed.written  # no marker: no checkpoint there
    assert len(said) == 1 and "warning: checkpoint step_5 was not copied to s3://b/ckpts" in said[0]
    assert "the next save is copied again" in said[0]


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_the_store_stopping_mid_copy_is_ridden_out_or_leaves_that_checkpoint_incomplete(small_dataset, s3, tmp_path):
    """The S3 server stopped for 12 s while step 4's copy is under way (each file's upload
    slowed by 0.3 s, so the copy takes about a second): past s3fs's own retries, ours wait and the
    copy completes. Stopped again while step 4's copy is under way, and the run killed
    during the outage: the store's step 4 has no marker, and a run on a fresh disk resumes
    from step 2, equal to the run that never stopped."""
    common = ["parallel.strategy=fsdp", "eval.every=0", "checkpoint.every=2", "checkpoint.keep=5", "train.log_every=1"]
    straight = tmp_path / "straight"
    check(train([*base_overrides(small_dataset, straight, steps=6), *common], nproc=2))
    slow = {"SCALETRAIN_SLOW": "upload:0.3"}

    def outage(prefix: str, seconds: float, then=lambda: None) -> tuple[threading.Thread, dict[str, Any]]:
        seen: dict[str, Any] = {}

        def watch() -> None:
            fs, deadline = s3.fs(), time.monotonic() + 300
            while time.monotonic() < deadline:
                fs.invalidate_cache()
                if fs.exists(f"{s3.bucket}/{prefix}/step_4") and not fs.exists(f"{s3.bucket}/{prefix}/step_4/COMPLETE"):
                    break
                time.sleep(0.1)
            seen["files_before"] = len(fs.find(f"{s3.bucket}/{prefix}/step_4"))
            s3.stop()
            then()
            time.sleep(seconds)
            s3.start()
            seen["done"] = True

        thread = threading.Thread(target=watch)
        thread.start()
        return thread, seen

    # Ridden out: the copy of step 4 completes once the store is back.
    ridden = tmp_path / "ridden"
    thread, seen = outage("ridden", 12)
    proc = train(
        [*base_overrides(small_dataset, ridden, steps=6), *common, f"checkpoint.dir={s3.url('ridden')}"], nproc=2, env=slow
    )
    thread.join()
    check(proc)
    assert seen.get("done") and seen["files_before"] >= 1, seen
    assert "; retrying for up to 120 s" in proc.stdout + proc.stderr
    assert s3.listing("ridden") == ["step_2", "step_4", "step_6"]
    assert step_figures(ridden) == step_figures(straight)
    # Killed during the outage: step 4's copy stays without its marker, step 2 is resumed.
    killed = tmp_path / "killed"
    args = [*base_overrides(small_dataset, killed, steps=6), *common, f"checkpoint.dir={s3.url('killed')}"]
    launched = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "launch", "--nproc", "2", *args], env={**os.environ, **slow},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    thread, seen = outage("killed", 3, then=lambda: (time.sleep(2), os.killpg(launched.pid, signal.SIGKILL)))
    launched.communicate(timeout=300)
    thread.join()
    assert seen.get("done"), seen
    fs = s3.fs()
    fs.invalidate_cache()
    assert fs.exists(f"{s3.bucket}/killed/step_4") and not fs.exists(f"{s3.bucket}/killed/step_4/COMPLETE")
    again = tmp_path / "again"
    proc = check(train([*base_overrides(small_dataset, again, steps=6), *common, f"checkpoint.dir={s3.url('killed')}"], nproc=2))
    assert f"resume: step 2 brought back from {s3.url('killed')}" in proc.stdout
    assert step_figures(again) == step_figures(straight)[2:]
