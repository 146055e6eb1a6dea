"""Token shards read from object storage (data/remote.py) through a real S3 server on
loopback (tests/s3_server.py): the same samples as from the local directory, read range by
range and checked against the block checksums; reads retried through a store that fails
for a while, and runs on s3:// equal to runs on local disk bit for bit, one with the
server stopped for seconds mid-run; the errors a user meets are one line; no file a run
writes holds the secret key."""

from __future__ import annotations

import threading
import time
import zlib

import numpy as np
import pytest

from s3_server import SECRET
from scaletrain.data.blocks import block_checksums
from scaletrain.data.loader import PackedTokens, RankBatches
from scaletrain.data.remote import BlockCache, StoreOptions, retried
from scaletrain.errors import UserError

from helpers.launch import check, one_line_error, scaletrain, train
from helpers.runs import SMALL_CORPUS, base_overrides, eval_rows, metric_rows


class Flaky:
    """A filesystem whose first `failures` reads fail as a dropped connection would."""

    protocol = "flaky"

    def __init__(self, data: bytes, failures: int, error: Exception | None = None):
        self.data, self.failures, self.reads = data, failures, 0
        self.error = error or ConnectionError("connection reset by peer")

    def cat_file(self, path: str, start: int = 0, end: int | None = None) -> bytes:
        self.reads += 1
        if self.failures:
            self.failures -= 1
            raise self.error
        return self.data[start:end]


@pytest.mark.unit
def test_a_block_read_is_retried_until_the_store_answers_and_checked_against_its_checksum(tmp_path):
    data = np.random.default_rng(0).integers(0, 2**16, 100_000, dtype=np.uint16).tobytes()
    fs = Flaky(data, failures=2)
    cache = BlockCache(fs, limit=3 << 14, block=1 << 14)  # three blocks of 16 KiB
    cache._sums["x"] = np.frombuffer(block_checksums(data, 1 << 14), dtype="<u4")
    assert cache.read("x", len(data), 30_000, 70_000) == data[30_000:70_000]  # blocks 1-4, the first read twice more
    assert fs.reads == 2 + 4 and cache.fetched == 4
    assert list(cache._blocks) == [("x", 2), ("x", 3), ("x", 4)]  # the bound: the oldest went
    # A block that differs from its checksum every time: retried, then one line.
    damaged = bytearray(data)
    damaged[20_000] ^= 1
    bad = BlockCache(Flaky(bytes(damaged), failures=0), block=1 << 14)
    bad._sums["x"] = cache._sums["x"]
    with pytest.raises(UserError, match="still failing after 1 s of retries .*block 1 differs from its checksum"):
        retried(lambda: bad._fetch("x", 1, 1 << 14, 2 << 14), "reading x", budget_s=1.0)
    # A missing object is not retried.
    gone = Flaky(data, failures=1, error=FileNotFoundError("s3://b/x"))
    with pytest.raises(UserError, match="not there .FileNotFoundError"):
        BlockCache(gone).read("x", len(data), 0, 10)
    assert gone.reads == 1


@pytest.mark.unit
def test_a_block_the_read_ahead_is_fetching_is_waited_for_not_fetched_twice():
    data = bytes(range(256)) * 1024

    class Slow(Flaky):
        def cat_file(self, path: str, start: int = 0, end: int | None = None) -> bytes:
            time.sleep(0.3)  # still in flight when the loop asks for it
            return super().cat_file(path, start, end)

    fs = Slow(data, failures=0)
    cache = BlockCache(fs, block=1 << 14)
    cache.ahead([("x", len(data), 20_000, 40_000)])  # blocks 1 and 2
    assert cache.read("x", len(data), 20_000, 40_000) == data[20_000:40_000]
    assert fs.reads == 2 and cache.fetched == 2
    assert cache.read("x", len(data), 16_384, 49_152) == data[16_384:49_152] and fs.reads == 2  # from the cache
    time.sleep(0.05)
    assert not cache._coming  # nothing left in flight


@pytest.fixture(scope="module")
def sharded(small_dataset, tmp_path_factory):
    """The small corpus in shards of 40,000 tokens (windows across shard ends), its tokenizer the session's."""
    out = tmp_path_factory.mktemp("sharded") / "data"
    tokenizer = str(small_dataset / "tokenizer.json")
    check(
        scaletrain(
            ["data", "prepare", "--input", *SMALL_CORPUS, "--out", str(out), "--tokenizer", tokenizer, "--shard-tokens", "40000"]
        )
    )
    return out


@pytest.fixture(scope="module")
def on_s3(sharded, s3_server):
    """That dataset copied to the server, under a bucket of its own."""
    from s3_server import with_bucket

    s3 = with_bucket(s3_server, "shared-data")
    return s3.upload(sharded, "sharded")


@pytest.mark.unit
def test_samples_from_s3_are_the_local_ones_read_range_by_range(sharded, on_s3, s3_server, monkeypatch, tmp_path):
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    local = PackedTokens(sharded, 64, seed=3)
    assert len(local.manifest["shards"]) >= 5
    options = StoreOptions(cache_dir=tmp_path / "cache", cache_bytes=1 << 18, local_dir=tmp_path / "data")  # 4 blocks of 64 KiB
    remote = PackedTokens(on_s3, 64, seed=3, store=options)
    assert remote.fingerprint == local.fingerprint and remote.samples_per_epoch == local.samples_per_epoch
    assert remote.tokenizer_path.read_bytes() == local.tokenizer_path.read_bytes()
    # Rank 1 of world 2 across the first epoch's end, 20 steps of 32 samples.
    start = local.samples_per_epoch - 320
    mine, theirs = (RankBatches(d, 8, 2, dp_rank=1, dp_size=2, start=start) for d in (local, remote))
    for _ in range(20):
        for (x, y), (u, v) in zip(mine.next_step(), theirs.next_step()):
            assert np.array_equal(x, u) and np.array_equal(y, v)
    # Every window of epoch 0 that spans a shard's end (read from two objects).
    local.sample_id(0)
    begins = local._perm * 64
    spanning = np.flatnonzero(
        np.searchsorted(local._starts, begins, "right") != np.searchsorted(local._starts, begins + 64, "right")
    )
    assert len(spanning) >= 5
    assert np.array_equal(remote.batch(spanning), local.batch(spanning))
    cache = remote.remote.cache
    assert cache.fetched > 8 and cache._held <= 1 << 18  # bounded in memory: blocks read again
    assert sum(p.stat().st_size for p in (tmp_path / "cache").iterdir()) <= 1 << 18  # and on disk
    # A later reader on the node finds the blocks last read on disk: none from the store.
    cache._pool.shutdown(wait=True)  # the read-ahead of a step never taken: done
    remote.batch(range(0, 2))
    again = PackedTokens(on_s3, 64, seed=3, store=options)
    assert np.array_equal(again.batch(range(0, 2)), local.batch(range(0, 2))) and again.remote.cache.fetched == 0
    remote.verify()


@pytest.mark.unit
def test_a_damaged_object_is_caught_on_the_ranges_read(sharded, s3, tmp_path, monkeypatch):
    url = s3.upload(sharded, "damaged")
    fs = s3.fs()
    path = f"{s3.bucket}/damaged/shard_00001.bin"
    raw = bytearray(fs.cat_file(path))
    raw[70_000] ^= 0xFF
    fs.pipe_file(path, bytes(raw))
    data = PackedTokens(url, 64, seed=0, store=StoreOptions(local_dir=tmp_path))
    shard = data._shards[1]
    assert np.array_equal(shard[0:1000], np.asarray(PackedTokens(sharded, 64, 0)._shards[1][0:1000]))  # block 0 intact
    monkeypatch.setattr("scaletrain.data.remote.RETRY_S", 1.0)
    with pytest.raises(UserError, match="differs from its checksum"):
        shard[35_000:35_010]  # byte 70,000: block 1
    assert zlib.crc32(bytes(raw[65536:131072])) != int(data.remote.cache._sums[shard.path][1])


def _equal_runs(s3_run, local_run, steps):
    a, b = metric_rows(local_run), metric_rows(s3_run)
    assert len(a) == len(b) == steps
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in b] == [r[key] for r in a], key


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_runs_reading_shards_from_s3_equal_runs_reading_them_from_disk(small_dataset, s3, tmp_path, strategy):
    url = s3.upload(small_dataset, "small")
    extra = [f"parallel.strategy={strategy}", "eval.every=0", f"data.dir={tmp_path / 'data'}"]
    local = tmp_path / "local"
    check(train([*base_overrides(small_dataset, local, steps=6), *extra], nproc=2))
    remote = tmp_path / "s3"
    check(train([*base_overrides(small_dataset, remote, steps=6), *extra, f"data.paths={url}"], nproc=2))
    _equal_runs(remote, local, 6)
    # The credentials came from the environment and went nowhere: no file the run wrote holds the secret.
    written = [p for p in remote.rglob("*") if p.is_file()]
    assert written and not [p for p in written if SECRET.encode() in p.read_bytes()]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_run_rides_out_the_store_stopping_for_seconds_mid_read(small_dataset, s3, tmp_path):
    """The server stopped for 12 s while a run reads (a cache of one block, so every step
    reads): past s3fs's own retries (about 9 s), ours wait and retry, no sample is lost or
    repeated (the losses are the local run's)."""
    url = s3.upload(small_dataset, "small")
    extra = ["parallel.strategy=fsdp", "eval.every=0", "train.log_every=1", f"data.dir={tmp_path / 'data'}"]
    local = tmp_path / "local"
    check(train([*base_overrides(small_dataset, local, steps=8), *extra], nproc=2))
    remote = tmp_path / "s3"
    outage: dict[str, float] = {}

    def interrupt() -> None:
        metrics = remote / "metrics.jsonl"
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and (not metrics.is_file() or len(metrics.read_text().splitlines()) < 2):
            time.sleep(0.05)
        outage["steps_before"] = len(metrics.read_text().splitlines()) if metrics.is_file() else -1
        s3.stop()
        time.sleep(12)
        s3.start()
        outage["done"] = 1

    thread = threading.Thread(target=interrupt)
    thread.start()
    args = [*base_overrides(small_dataset, remote, steps=8), *extra, f"data.paths={url}", "data.cache_bytes=65536"]
    proc = train(args, nproc=2)
    thread.join()
    check(proc)
    assert outage.get("done") and 2 <= outage["steps_before"] < 8, outage
    assert "; retrying for up to 120 s" in proc.stdout + proc.stderr  # a read met the outage (one line, not one per block)
    _equal_runs(remote, local, 8)


def _one_step(tmp_path):
    """A one-step run's arguments, its data.paths still to give."""
    return [
        "model.preset=tiny",
        "train.steps=1",
        "run.device=cpu",
        f"run.dir={tmp_path / 'run'}",
        f"data.dir={tmp_path / 'data'}",
    ]


@pytest.mark.e2e
def test_a_missing_bucket_or_prefix_is_one_line(s3, tmp_path):
    base = _one_step(tmp_path)
    proc = train([*base, "data.paths=s3://no-such-bucket/data"])
    one_line_error(
        proc, "'s3://no-such-bucket/data' has no manifest.json", "accepted: a directory made by `scaletrain data prepare`"
    )
    proc = train([*base, f"data.paths={s3.url('nothing-here')}"])
    one_line_error(proc, f"{s3.url('nothing-here')!r} has no manifest.json")


@pytest.mark.e2e
def test_refused_credentials_are_one_line(on_s3, s3_server, monkeypatch, tmp_path):
    """The server checking credentials (moto's authorization, on for this test), the key in
    the environment unknown to it: one line at start, exit 2, and the secret nowhere in it."""
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    base = _one_step(tmp_path)
    proc = train([*base, f"data.paths={on_s3}"])
    one_line_error(proc, f"{on_s3}/manifest.json: the store refused the credentials in the environment (PermissionError")
    assert SECRET not in proc.stdout + proc.stderr


@pytest.mark.e2e
def test_data_prepared_straight_to_s3_is_the_local_preparation(sharded, small_dataset, s3, tmp_path):
    url = s3.url("prepared")
    args = ["data", "prepare", "--input", *SMALL_CORPUS, "--tokenizer", str(small_dataset / "tokenizer.json"),
            "--shard-tokens", "40000", "--out", url]  # fmt: skip
    check(scaletrain(args))
    there = PackedTokens(url, 64, seed=0, store=StoreOptions(local_dir=tmp_path))
    here = PackedTokens(sharded, 64, seed=0)
    assert there.fingerprint == here.fingerprint and np.array_equal(there.batch(range(40)), here.batch(range(40)))
    names = {p.rsplit("/", 1)[-1] for p in s3.fs().ls(f"{s3.bucket}/prepared")}
    assert names == {p.name for p in sharded.iterdir()}  # shards, their block checksums, tokenizer, manifest
    one_line_error(scaletrain(args), f"{url} already holds a prepared dataset (manifest.json)")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_eval_data_and_a_mixture_s_source_from_s3_equal_them_from_disk(sharded, small_dataset, s3, tmp_path):
    url = s3.upload(sharded, "sharded")
    runs = {}
    for name, there in (("disk", str(sharded)), ("s3", url)):
        run = tmp_path / name
        mix = f"data.mix=[{{paths: [{there}], weight: 1}}, {{paths: [{small_dataset}], weight: 2}}]"
        args = [*base_overrides(small_dataset, run, steps=4), "data.paths=[]", mix, f"eval.data=[{there}]", "eval.every=2",
                "eval.batches=1", f"data.dir={tmp_path / 'data'}"]  # fmt: skip
        check(train(args))
        runs[name] = (metric_rows(run), eval_rows(run))
    assert [r["loss"] for r in runs["s3"][0]] == [r["loss"] for r in runs["disk"][0]]
    assert [r["loss"] for r in runs["s3"][1]] == [r["loss"] for r in runs["disk"][1]] and len(runs["disk"][1]) == 2
