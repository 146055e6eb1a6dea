"""checkpoint.dir as a URL (checkpoint/remote.py), against the S3 server on loopback
(tests/s3_server.py): checkpoints copied there (marker last, keep-k), and a run on a machine
that has none of them resumed from there at another world size, equal to the same resume
from local disk bit for bit; the newest-complete rule and the verification on resume hold
in the store as on disk."""

from __future__ import annotations

import pytest

from s3_server import SECRET
from scaletrain.telemetry.metrics import read_metrics

from helpers import base_overrides, check, one_line_error, train


def _losses(run):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run / "metrics.jsonl")]


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
    assert _losses(second) == _losses(local)[6:]
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
    assert "resume: skipping" in proc.stdout and "step_4" in proc.stdout
    assert "resume: step 2 brought back" in proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "second" / "metrics.jsonl")] == [3, 4, 5, 6, 7]


@pytest.mark.e2e
def test_a_checkpoint_dir_that_is_not_a_url_or_not_there_is_one_line(small_dataset, s3, tmp_path):
    proc = train([*base_overrides(small_dataset, tmp_path / "run", steps=1), f"checkpoint.dir={tmp_path / 'ckpts'}"])
    one_line_error(proc, "checkpoint.dir=", "is not a URL; accepted: a URL of object storage (s3://bucket/prefix)")
    proc = train([*base_overrides(small_dataset, tmp_path / "run", steps=1), "checkpoint.dir=s3://no-such-bucket/ckpts"])
    one_line_error(proc, "checkpoint.dir=s3://no-such-bucket/ckpts: its bucket 'no-such-bucket' does not exist")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # at start, before any step


@pytest.mark.unit
def test_a_copy_writes_its_marker_last(tmp_path):
    from scaletrain.checkpoint.remote import CheckpointStore

    local = tmp_path / "step_5"
    (local / "state").mkdir(parents=True)
    for name in ("COMPLETE", "trainer.json", "state/__0_0.distcp", "config.yaml"):
        (local / name).write_text(name)

    class Recording:
        protocol = "memory"
        written: list[str] = []

        def put_file(self, src: str, dst: str) -> None:
            self.written.append(dst)

    store = CheckpointStore.__new__(CheckpointStore)
    store.url, store.fs, store.root = "s3://b/ckpts", Recording(), "b/ckpts"
    store.upload(local)
    assert Recording.written[-1] == "b/ckpts/step_5/COMPLETE" and len(Recording.written) == 4
