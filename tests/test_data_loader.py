"""PackedTokens / RankBatches: coverage per epoch, shuffling, resume and batch layouts."""

from __future__ import annotations

import json
import shutil
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.data import PackedTokens, RankBatches, prepare_dataset
from scaletrain.errors import UserError

pytestmark = pytest.mark.unit

SEQ = 37  # does not divide the shard size, so some windows span two shards
SHARD = 3000


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("loader_corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("bisect.py", "colorsys.py", "heapq.py", "keyword.py", "fnmatch.py"):
        shutil.copyfile(stdlib / name, src / (Path(name).stem + ".txt"))
    out = tmp_path_factory.mktemp("loader_data") / "ds"
    return prepare_dataset([str(src / "*.txt")], out, vocab_size=320, shard_tokens=SHARD, show_progress=False)


@pytest.fixture()
def data(dataset) -> PackedTokens:
    return PackedTokens(dataset, SEQ, seed=7)


def _shard_arrays(d: Path) -> list[np.ndarray]:
    m = json.loads((d / "manifest.json").read_text())
    return [np.fromfile(d / s["file"], dtype=m["dtype"]).astype(np.int64) for s in m["shards"]]


def _draw(batches: list[RankBatches]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    return [b.next_step() for b in batches]


def test_metadata(data, dataset):
    m = json.loads((dataset / "manifest.json").read_text())
    assert data.vocab_size == m["vocab_size"] and data.eos_id == m["eos_id"]
    assert data.tokenizer_path == dataset / "tokenizer.json" and data.tokenizer_path.is_file()
    assert data.samples_per_epoch == (m["total_tokens"] - 1) // SEQ
    assert len(m["shards"]) >= 4
    data.verify()


def test_windows_are_the_epoch_stream(data, dataset):
    """Independent reconstruction: concatenate the shard files in the epoch's order, cut windows."""
    shards = _shard_arrays(dataset)
    spe = data.samples_per_epoch
    spanning = 0
    for epoch in (0, 1):
        order = data.shard_order(epoch)
        assert sorted(order) == list(range(len(shards)))
        stream = np.concatenate([shards[i] for i in order])
        bounds = np.cumsum([len(shards[i]) for i in order])
        idx = np.arange(epoch * spe, (epoch + 1) * spe)
        got = data.batch(idx)
        for row, g in enumerate(idx):
            e, w = data.sample_id(int(g))
            assert e == epoch
            window = stream[w * SEQ : w * SEQ + SEQ + 1]
            np.testing.assert_array_equal(got[row], window)
            np.testing.assert_array_equal(data.sample(int(g)), window)  # scalar path agrees
            spanning += bool(((bounds > w * SEQ) & (bounds < w * SEQ + SEQ + 1)).any())
    assert spanning > 0, "the fixture must exercise windows that cross a shard boundary"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_window_once_per_epoch(data, world):
    spe = data.samples_per_epoch
    micro, accum = next((mb, ga) for mb in (3, 5, 7, 11) for ga in (2, 3) if spe % (mb * ga * world))
    ranks = [RankBatches(data, micro, accum, r, world) for r in range(world)]
    per_step = micro * accum * world
    assert spe % per_step != 0  # the epoch boundary falls inside a step
    seen: list[tuple[int, int]] = []
    steps = -(-spe // per_step)
    for _ in range(steps):
        start = ranks[0].position
        indices = [list(ix) for r in ranks for ix in r.step_indices()]
        flat = sorted(g for ix in indices for g in ix)
        assert flat == list(range(start, start + per_step))  # ranks split the step exactly
        for r, out in zip(ranks, _draw(ranks)):
            assert len(out) == accum and r.position == start + per_step
            for ix, (x, y) in zip(RankBatches(data, micro, accum, r.dp_rank, world, start).step_indices(), out):
                assert x.shape == y.shape == (micro, SEQ) and x.dtype == y.dtype == torch.int64
                ref = torch.from_numpy(data.batch(ix))
                assert torch.equal(x, ref[:, :-1]) and torch.equal(y, ref[:, 1:])
                seen += [data.sample_id(g) for g in ix]
    counts = Counter(w for e, w in seen if e == 0)
    assert sorted(counts) == list(range(spe)) and set(counts.values()) == {1}
    spill = [w for e, w in seen if e == 1]
    assert len(spill) == steps * per_step - spe > 0 and len(set(spill)) == len(spill)


def test_epoch_orders_differ(data, dataset):
    spe = data.samples_per_epoch
    e0 = [data.sample_id(g)[1] for g in range(spe)]
    e1 = [data.sample_id(g)[1] for g in range(spe, 2 * spe)]
    assert sorted(e0) == sorted(e1) == list(range(spe))
    assert e0 != e1
    # Within an epoch consecutive samples are not neighbouring windows of the text.
    assert sum(b == a + 1 for a, b in zip(e0, e0[1:])) < spe // 10
    assert len({tuple(data.shard_order(e)) for e in range(6)}) > 1
    # Another seed, another order; the same seed, the same order in a fresh instance.
    assert [PackedTokens(dataset, SEQ, seed=8).sample_id(g)[1] for g in range(spe)] != e0
    assert [PackedTokens(dataset, SEQ, seed=7).sample_id(g)[1] for g in range(spe)] == e0


def _cat(out: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x for x, _ in out]), torch.cat([y for _, y in out])


def test_resume_matches_uninterrupted(data):
    a = RankBatches(data, 4, 2, 1, 2)
    for _ in range(9):
        a.next_step()
    b = RankBatches(data, 4, 2, 1, 2, start=a.position)
    for _ in range(5):
        for (xa, ya), (xb, yb) in zip(a.next_step(), b.next_step()):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.position == b.position


def test_resume_with_another_world_size_continues_the_stream(data):
    one = RankBatches(data, 8, 1, 0, 1)
    for _ in range(3):
        one.next_step()
    pos = one.position
    two = [RankBatches(data, 4, 1, r, 2, start=pos) for r in range(2)]
    for _ in range(4):
        ref = _cat(one.next_step())
        got = [_cat(o) for o in _draw(two)]
        assert torch.equal(torch.cat([g[0] for g in got]), ref[0])
        assert torch.equal(torch.cat([g[1] for g in got]), ref[1])


def test_world2_equals_world1_double_micro_batch(data):
    one = RankBatches(data, 4, 1, 0, 1, start=5)
    two = [RankBatches(data, 2, 1, r, 2, start=5) for r in range(2)]
    for _ in range(6):
        ((x1, y1),) = one.next_step()
        parts = [o[0] for o in _draw(two)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x1)
        assert torch.equal(torch.cat([p[1] for p in parts]), y1)


def test_accumulation_equals_one_big_batch(data):
    accum = RankBatches(data, 2, 4, 0, 1)
    big = RankBatches(data, 8, 1, 0, 1)
    for _ in range(5):
        out = accum.next_step()
        assert len(out) == 4
        x, y = _cat(out)
        ((bx, by),) = big.next_step()
        assert torch.equal(x, bx) and torch.equal(y, by)
    # World 2 x accumulation 2 x micro 2: micro-batch m of all ranks, then m + 1, ... is the
    # same contiguous run of 8 samples.
    ranks = [RankBatches(data, 2, 2, r, 2) for r in range(2)]
    ref = RankBatches(data, 8, 1, 0, 1)
    outs = _draw(ranks)
    order = [outs[r][m] for m in range(2) for r in range(2)]
    ((rx, ry),) = ref.next_step()
    assert torch.equal(torch.cat([o[0] for o in order]), rx) and torch.equal(torch.cat([o[1] for o in order]), ry)


def test_targets_are_inputs_shifted(data):
    b = RankBatches(data, 6, 2, 0, 1)
    for _ in range(3):
        for x, y in b.next_step():
            assert torch.equal(x[:, 1:], y[:, :-1])
            assert int(x.max()) < data.vocab_size and int(x.min()) >= 0


def test_too_small_and_damaged_data(dataset, tmp_path):
    total = json.loads((dataset / "manifest.json").read_text())["total_tokens"]
    assert PackedTokens(dataset, total - 1, seed=0).samples_per_epoch == 1
    with pytest.raises(UserError, match=rf"too few for data\.seq_len = {total}"):
        PackedTokens(dataset, total, seed=0)

    with pytest.raises(UserError, match="has no manifest.json"):
        PackedTokens(tmp_path, SEQ, seed=0)

    broken = tmp_path / "broken"
    shutil.copytree(dataset, broken)
    shard = broken / "shard_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(UserError, match=r"shard_00001\.bin: \d+ bytes but manifest\.json says"):
        PackedTokens(broken, SEQ, seed=0)

    shard.write_bytes(b"\0" * (SHARD * 2))  # right size, wrong content
    damaged = PackedTokens(broken, SEQ, seed=0)
    with pytest.raises(UserError, match="checksum"):
        damaged.verify()


def test_bad_rank_arguments(data):
    with pytest.raises(ValueError):
        RankBatches(data, 2, 1, 2, 2)
    with pytest.raises(ValueError):
        RankBatches(data, 0, 1, 0, 1)
    with pytest.raises(IndexError):
        data.sample(-1)
