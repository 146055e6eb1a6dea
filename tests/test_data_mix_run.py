"""Acceptance for data.mix in a run: the realised shares in metrics.jsonl's interval rows,
and a mixture killed after its checkpoint at world 2 and resumed at world 1 trains exactly
as one process straight through (the global sample index keeps its meaning); bad mixtures
through the CLI: one line, exit 2. The mapping's statistics are checked without
processes, in test_data_mix.py."""

from __future__ import annotations

import pytest

from scaletrain.cli import main
from scaletrain.data import prepare_dataset
from scaletrain.telemetry import read_metrics

from helpers.launch import check, train
from helpers.numerics import assert_same_training
from helpers.runs import STDLIB, base_overrides, eval_overrides, train_through

STEPS, EVERY, GLOBAL_BATCH = 4, 2, 4


def _overrides(small_dataset, run, cache, world: int = 1) -> list[str]:
    # Source 1 is text: the run tokenizes it with source 0's tokenizer (a prepared directory).
    mix = f"data.mix=[{{paths: [{small_dataset}], weight: 0.7}}, {{paths: ['{STDLIB / 'html' / '*.py'}'], weight: 0.3}}]"
    base = [o for o in base_overrides(small_dataset, run, steps=STEPS) if not o.startswith("data.paths=")]
    # Evaluated on source 0 after each link's last step: eval rows survive the move too.
    evals = [*eval_overrides(small_dataset, every=EVERY), f"eval.micro_batch={GLOBAL_BATCH // world}"]
    return [
        *base,
        mix,
        *evals,
        f"data.dir={cache}",
        f"train.log_every={EVERY}",
        f"checkpoint.every={EVERY}",
        "parallel.strategy=fsdp",
    ]


def _mix_fields(run) -> dict[int, dict]:
    return {r["step"]: r["mix"] for r in read_metrics(run / "metrics.jsonl", events=True) if r.get("event") == "interval"}


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_mixture_resumed_at_another_world_size_is_the_straight_run(small_dataset, tmp_path):
    cache = tmp_path / "cache"
    straight = tmp_path / "straight"
    check(train([*_overrides(small_dataset, straight, cache), f"train.micro_batch={GLOBAL_BATCH}"]))
    # 0.7/0.3 is the block [0, 1, 0, 0, 0, 1, 0, 0, 1, 0] (data/mix.py); each interval reads
    # 2 steps x 4 samples: samples 0-7, then 8-15.
    fields = _mix_fields(straight)
    assert fields[2]["samples"] == [6, 2] and fields[4]["samples"] == [5, 3], fields
    assert fields[4]["total"] == [11, 5] and fields[4]["share"] == [0.625, 0.375] and fields[4]["target"] == [0.7, 0.3]
    assert fields[4]["total_share"] == [0.6875, 0.3125] and all(0 < e < 1 for e in fields[4]["epochs"])

    run = tmp_path / "run"
    links = [
        ([*_overrides(small_dataset, run, cache, world=2), f"train.micro_batch={GLOBAL_BATCH // 2}"], 2, "fsdp at world 2"),
        ([*_overrides(small_dataset, run, cache), f"train.micro_batch={GLOBAL_BATCH}"], 1, "fsdp at world 1"),
    ]
    train_through(run, links, every=EVERY)
    assert_same_training(run, straight, steps=STEPS)
    assert _mix_fields(run) == fields  # the resumed run's intervals read the same samples


@pytest.mark.e2e
def test_bad_mixtures_are_one_line_exit_2(small_dataset, tmp_path, capsys):
    other = prepare_dataset([str(STDLIB / "keyword.py")], tmp_path / "other", vocab_size=300, show_progress=False)
    run = ["train", f"run.dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'cache'}", "run.device=cpu", "train.steps=1"]
    cases = {
        f"data.mix=[{{paths: [{small_dataset}], weight: 0.7}}, {{paths: [{other}], weight: 0}}]": (
            "config: data.mix[1].weight = 0 is invalid; accepted: a finite number > 0"
        ),
        f"data.mix=[{{paths: [{small_dataset}], weight: 1}}, {{paths: ['{tmp_path}/none/*.txt'], weight: 1}}]": (
            f"data.mix[1].paths: '{tmp_path}/none/*.txt' matches no file; accepted:"
        ),
        f"data.mix=[{{paths: [{small_dataset}], weight: 1}}, {{paths: [{other}], weight: 1}}]": (
            f"data.mix[1]: its tokenizer ({other}/tokenizer.json, vocabulary 300) differs from data.mix[0]'s"
        ),
    }
    for mix, says in cases.items():
        assert main([*run, mix]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("scaletrain: error:") and says in err[0], err
    assert main([*run, f"data.paths={small_dataset}", f"data.mix=[{{paths: [{other}], weight: 1}}]"]) == 2
    assert "data.mix and data.paths=" in capsys.readouterr().err
