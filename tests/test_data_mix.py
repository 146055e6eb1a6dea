"""Data mixtures (data/mix.py): the mapping from the global sample index to (source, index
in that source), read back at the loader level, without processes; the errors; the
interval field in TensorBoard. The run-level checks (the field in metrics.jsonl, a resume
at another world size) are in test_data_mix_run.py."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain.config import DataConfig, TelemetryConfig, load_config
from scaletrain.data import DataMix, MixShares, PackedTokens, RankBatches, mix_to_prepare, open_mix, prepare_dataset
from scaletrain.data.mix import MAX_BLOCK, block_quotas, deal_block
from scaletrain.errors import UserError

pytestmark = pytest.mark.unit

SEQ = 31
STDLIB = Path(sysconfig.get_paths()["stdlib"])
GLOBAL_BATCH, STEPS = 8, 200  # a run's global batch (micro 4 x dp 2) and its length


def _corpus(tmp: Path, names: list[str]) -> str:
    for name in names:
        shutil.copyfile(STDLIB / name, tmp / (Path(name).stem + ".txt"))
    return str(tmp / "*.txt")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, Path]:
    """big and small share big's tokenizer; other trained its own."""
    src = {k: tmp_path_factory.mktemp(f"mix_src_{k}") for k in ("big", "small", "other")}
    out = tmp_path_factory.mktemp("mix_data")
    big = prepare_dataset([_corpus(src["big"], ["bisect.py", "heapq.py", "colorsys.py"])], out / "big",
                          vocab_size=300, shard_tokens=2048, show_progress=False)  # fmt: skip
    small = prepare_dataset([_corpus(src["small"], ["keyword.py"])], out / "small", tokenizer=str(big / "tokenizer.json"),
                            shard_tokens=2048, show_progress=False)  # fmt: skip
    other = prepare_dataset([_corpus(src["other"], ["fnmatch.py"])], out / "other", vocab_size=300, show_progress=False)
    return {"big": big, "small": small, "other": other}


def _mix(prepared: dict[str, Path], weights: list[float], names: tuple[str, ...] = ("big", "small")) -> DataMix:
    return DataMix([PackedTokens(prepared[n], SEQ, seed=7) for n in names], weights)


def _run_stream(mix: DataMix, dp: int, micro: int, accum: int, steps: int, start: int = 0) -> torch.Tensor:
    """The global batch of each step as the ranks read it: micro-batch m of every rank, in rank order."""
    ranks = [RankBatches(mix, micro, accum, r, dp, start=start) for r in range(dp)]
    out = []
    for _ in range(steps):
        drawn = [r.next_step() for r in ranks]
        out += [torch.cat([x, y[:, -1:]], dim=1) for m in range(accum) for x, y in (drawn[r][m] for r in range(dp))]
    return torch.cat(out)


def test_70_30_realised_share_at_every_step(prepared):
    mix = _mix(prepared, [0.7, 0.3])
    ranks = [RankBatches(mix, 4, 1, r, 2) for r in range(2)]
    counts = np.zeros(2, dtype=np.int64)
    for step in range(1, STEPS + 1):
        for r in ranks:
            for ix in r.step_indices():
                counts += np.bincount(mix.locate(ix)[0], minlength=2)
            r.position += r.samples_per_step
        # Every prefix: within one sample of 70% (the greedy's bound), from the first step on.
        assert abs(counts[0] - 0.7 * step * GLOBAL_BATCH) < 1, (step, counts)
    share = counts[0] / counts.sum()
    assert abs(share - 0.7) <= 0.02 and counts.sum() == STEPS * GLOBAL_BATCH  # the bound, met exactly here
    assert list(mix.counts(STEPS * GLOBAL_BATCH)) == list(counts)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [5, 3, 2], [1, 2**0.5, 3**0.5], [0.013, 0.987], [1, 1, 1]])
def test_every_prefix_stays_close_to_the_weights(weights):
    quotas = block_quotas(weights)
    shares = np.array(weights) / sum(weights)
    block = int(quotas.sum())
    assert block <= MAX_BLOCK and (np.abs(quotas / block - shares) <= 1 / MAX_BLOCK).all()
    slot, before = deal_block(quotas)
    n = 3 * block + 17  # several blocks and part of one
    chosen = slot[np.arange(n) % block]
    counts = np.cumsum(np.eye(len(weights), dtype=np.int64)[chosen], axis=0)
    # At every prefix each source is within 1 sample of its block share, and within
    # 1 + n / MAX_BLOCK of the weight itself (the block share's rounding).
    prefix = np.arange(1, n + 1)[:, None]
    assert (np.abs(counts - prefix * quotas / block) < 1).all()
    assert (np.abs(counts - prefix * shares) < 1 + prefix / MAX_BLOCK).all()


def test_ratios_of_small_integers_are_exact():
    assert block_quotas([0.7, 0.3]).tolist() == [7, 3]
    assert block_quotas([7, 3]).tolist() == [7, 3]
    assert block_quotas([1, 1, 1]).tolist() == [1, 1, 1]
    assert block_quotas([5]).tolist() == [1]
    assert int(block_quotas([1, 2**0.5]).sum()) == MAX_BLOCK  # irrational: the largest remainders


def test_each_source_index_advances_contiguously(prepared):
    mix = _mix(prepared, [0.7, 0.3])
    source, index = mix.locate(range(5000))
    for s in range(2):
        # Index k of a source is its k-th turn: 0, 1, 2, ... in global order, none skipped or repeated.
        assert index[source == s].tolist() == list(range(int((source == s).sum())))
    # The count of earlier choices, computed the slow way, sample by sample.
    seen = [0, 0]
    for g in range(0, 5000, 7):
        s = int(source[g])
        assert index[g] == int((source[:g] == s).sum())
        seen[s] += 1
    assert all(seen)


def test_rows_come_from_their_source_with_its_own_epochs(prepared):
    mix = _mix(prepared, [0.7, 0.3])
    small = mix.sources[1]
    n = int(np.ceil(2.5 * small.samples_per_epoch / 0.3))  # the small source wraps twice
    got = mix.batch(range(n))
    source, index = mix.locate(range(n))
    for s, data in enumerate(mix.sources):
        rows = np.nonzero(source == s)[0]
        np.testing.assert_array_equal(got[rows], data.batch(index[rows]))
    # Index k of the small source is its own global sample k: its epoch k // its epoch size.
    wrapped = index[source == 1]
    assert wrapped.max() >= 2 * small.samples_per_epoch
    epochs = {small.sample_id(int(k))[0] for k in wrapped}
    assert epochs == {0, 1, 2}
    # The big source is still in its first epoch: each source counts its own.
    assert index[source == 0].max() < mix.sources[0].samples_per_epoch
    field = mix.shares(0, n)
    assert field["total"] == [int((source == 0).sum()), int((source == 1).sum())]
    assert field["epochs"] == [round(t / d.samples_per_epoch, 4) for t, d in zip(field["total"], mix.sources)]
    assert field["epochs"][1] > 2 > 1 > field["epochs"][0]


@pytest.mark.parametrize("dp, micro, accum", [(2, 4, 1), (2, 2, 2), (4, 1, 2)])
def test_same_global_stream_at_every_data_parallel_size(prepared, dp, micro, accum):
    mix = _mix(prepared, [0.7, 0.3])
    one = _run_stream(mix, 1, 8, 1, 12)
    np.testing.assert_array_equal(_run_stream(mix, dp, micro, accum, 12), one)
    # A resume at another size after 5 steps continues the same stream.
    np.testing.assert_array_equal(_run_stream(mix, dp, micro, accum, 7, start=5 * 8), one[5 * 8 :])
    # And a fresh instance (another process) computes the same mapping.
    np.testing.assert_array_equal(_run_stream(_mix(prepared, [0.7, 0.3]), 1, 8, 1, 12), one)


def test_one_source_mixture_is_the_plain_stream(prepared):
    plain = PackedTokens(prepared["big"], SEQ, seed=7)
    np.testing.assert_array_equal(_mix(prepared, [3.0], ("big",)).batch(range(400)), plain.batch(range(400)))


def test_fingerprint_covers_sources_and_weights(prepared):
    a = _mix(prepared, [0.7, 0.3])
    assert a.fingerprint == _mix(prepared, [7, 3]).fingerprint  # the same stream
    assert a.fingerprint != _mix(prepared, [0.6, 0.4]).fingerprint
    assert a.fingerprint != _mix(prepared, [0.3, 0.7], ("small", "big")).fingerprint


def test_interval_shares(prepared):
    mix = _mix(prepared, [0.7, 0.3])
    position = [40]
    shares = MixShares(mix, lambda: position[0])  # a run resumed at sample 40
    position[0] = 40 + 3 * GLOBAL_BATCH
    field = shares.take()
    assert field["samples"] == [17, 7] and field["share"] == [round(17 / 24, 4), round(7 / 24, 4)]
    assert field["total"] == [45, 19] and field["total_share"] == [round(45 / 64, 4), round(19 / 64, 4)]
    assert field["target"] == [0.7, 0.3]
    position[0] += 10 * GLOBAL_BATCH
    assert shares.take()["samples"] == [56, 24]


def test_config_errors_are_one_line():
    cases = {
        "data.mix=[{paths: [a], weight: 0.7}, {paths: [b], weight: 0}]": "data.mix[1].weight = 0 is invalid; accepted: a finite number > 0",
        "data.mix=[{paths: [a], weight: -1}]": "data.mix[0].weight = -1 is invalid",
        "data.mix=[{paths: [], weight: 1}]": "data.mix[0].paths is empty; accepted:",
        "data.mix=[{paths: [a]}]": "config key data.mix.0.weight is missing",
        "data.mix=[{paths: [a], weigth: 1}]": "data.mix.0.weigth (did you mean data.mix.0.weight?); accepted keys in data.mix.0: paths, weight",
    }  # fmt: skip
    for override, expected in cases.items():
        with pytest.raises(UserError) as e:
            load_config([], [override])
        assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(UserError, match=r"data\.mix and data\.paths=\['x'\] both say what to train on; accepted: one of them"):
        load_config([], ["data.paths=x", "data.mix=[{paths: [a], weight: 1}]"])
    assert load_config([], ["data.mix=[{paths: a, weight: 7}]"]).data.mix[0].paths == ["a"]


def test_missing_empty_and_mismatched_sources(prepared, tmp_path):
    def cfg(*sources: tuple[list[str], float]) -> DataConfig:
        return DataConfig(mix=[{"paths": p, "weight": w} for p, w in sources], dir=str(tmp_path / "cache"), seq_len=SEQ)

    with pytest.raises(UserError, match=r"^data\.mix\[1\]\.paths: '.*/nothing/\*\.txt' matches no file; accepted: "):
        mix_to_prepare(cfg(([str(prepared["big"])], 0.7), ([str(tmp_path / "nothing" / "*.txt")], 0.3)))
    (tmp_path / "empty.txt").write_text("")
    from scaletrain.data import prepare_mix

    with pytest.raises(UserError, match=r"^data\.mix\[1\]: inputs hold no text \(all 1 file\(s\) empty\)"):
        prepare_mix(cfg(([str(prepared["big"])], 0.7), ([str(tmp_path / "empty.txt")], 0.3)), show_progress=False)
    with pytest.raises(UserError, match=r"^data\.mix\[1\]: its tokenizer \(.*other/tokenizer\.json, vocabulary \d+\) differs from data\.mix\[0\]'s"):  # fmt: skip
        open_mix(cfg(([str(prepared["big"])], 0.7), ([str(prepared["other"])], 0.3)), seed=0)
    with pytest.raises(UserError, match=r"^data\.mix\[1\]\.weight = 1e-06 is under 1/16384 of the total"):
        _mix(prepared, [1, 1e-6])
    mixed = open_mix(cfg(([str(prepared["big"])], 0.7), ([str(prepared["small"])], 0.3)), seed=7)
    np.testing.assert_array_equal(mixed.batch(range(50)), _mix(prepared, [0.7, 0.3]).batch(range(50)))


def test_text_sources_share_the_first_sources_tokenizer(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    data = DataConfig(
        mix=[{"paths": [_corpus(a, ["bisect.py", "heapq.py"])], "weight": 2}, {"paths": [_corpus(b, ["keyword.py"])], "weight": 1}],
        dir=str(tmp_path / "cache"), seq_len=SEQ, vocab_size=300, shard_tokens=2048,
    )  # fmt: skip
    assert mix_to_prepare(data)
    from scaletrain.data import prepare_mix

    first, second = prepare_mix(data, show_progress=False)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    mix = open_mix(data, seed=1)
    assert [s.dir for s in mix.sources] == [first, second] and mix.quotas.tolist() == [2, 1]


def test_tensorboard_gets_a_scalar_per_source(tmp_path):
    from scaletrain.telemetry.sinks import Sinks

    from sink_readers import tensorboard_scalars

    sinks = Sinks(TelemetryConfig(tensorboard=True), tmp_path, {}, resumed_step=0)
    mix = {"samples": [7, 3], "share": [0.7, 0.3], "total": [14, 6], "total_share": [0.7, 0.3], "epochs": [0.5, 1.25]}
    sinks.log_event({"step": 4, "event": "interval", "steps": 2, "mix": mix})
    sinks.close()
    tb = tensorboard_scalars(tmp_path / "tensorboard")
    assert tb["data/source0/share"] == pytest.approx({4: 0.7}) and tb["data/source1/epochs"] == {4: 1.25}
    assert tb["data/source1/total_share"] == pytest.approx({4: 0.3})
