"""`scaletrain bench --suite clock-gpu` (bench/clock_recorded.py): the runs recorded under
docs/gpu/ read back as their `scaletrain train` commands, planned again on their GPU, and the
table docs/planner.md holds: which rows are runs, what of a command is kept, the defaults a
run applied, and the note on a run measured while it warmed up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.bench.clock_recorded import compare_recorded, recorded_runs, table

pytestmark = pytest.mark.unit

TRAIN = "/opt/torch/.venv/bin/python3 -m scaletrain train model.preset=tiny run.device=cuda precision=bf16"


def _recorded(root: Path) -> Path:
    folder = root / "2026-01-01-h200"
    folder.mkdir(parents=True)
    (folder / "env.json").write_text(json.dumps({"device_name": "NVIDIA H200", "device_memory": 150_000_000_000}))
    rows = [
        # 3 steps, as the first checklist ran its engine checks; its run directory and logging dropped.
        {"name": "tiny-3", "cmd": f"{TRAIN} train.steps=3 train.log_every=1 run.dir=/tmp/a checkpoint.every=0",
         "data": {"step_s": 0.020, "steps": 3, "device": "cuda"}},
        # 20 steps, with the defaults it applied recorded beside its command (scripts/gpu_peers.py).
        {"name": "tiny-20", "cmd": f"{TRAIN} train.steps=20 train.resume=never",
         "data": {"step_s": 0.018, "steps": 20, "device": "cuda", "resolved": ["train.compile=false"]}},
        {"name": "a plan", "cmd": "python3 -m scaletrain plan model.preset=tiny", "data": {"step_s": 1.0}},
        {"name": "on the host", "cmd": f"{TRAIN} run.device=cpu", "data": {"step_s": 0.5, "device": "cpu"}},
        {"name": "failed", "cmd": f"{TRAIN} train.steps=3", "data": None},
    ]  # fmt: skip
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_recorded_train_rows_are_read_as_they_ran(tmp_path: Path) -> None:
    runs = recorded_runs(_recorded(tmp_path))
    assert [r.name for r in runs] == ["tiny-3", "tiny-20"]
    three, twenty = runs
    assert three.overrides == ("model.preset=tiny", "run.device=cuda", "precision=bf16", "train.steps=3")
    assert twenty.overrides[-1] == "train.compile=false" and "train.resume=never" not in twenty.overrides
    assert (three.device, three.memory, three.measured_s, three.steps) == ("NVIDIA H200", 150_000_000_000, 0.020, 3)
    assert three.source == "2026-01-01-h200/results.jsonl"


def test_the_table_plans_each_run_again_and_notes_one_measured_while_warming_up(tmp_path: Path) -> None:
    said: list[str] = []
    rows = compare_recorded(_recorded(tmp_path), said.append)
    assert [r.name for r in rows] == ["tiny-3", "tiny-20"] and len(said) == 2
    assert all(r.predicted_s > 0 and r.phases["forward"] > 0 for r in rows)
    text = table(rows)
    assert "| tiny-3 | 2026-01-01-h200/results.jsonl | NVIDIA H200 | 20.0 ms |" in text
    assert "2 runs: median |error|" in text
    warm = [line for line in text.splitlines() if "warming up" in line]
    assert warm == ["- tiny-3 (2026-01-01-h200/results.jsonl): 3 steps, measured while warming up (the median of steps 2-3)"]


def test_a_published_run_is_planned_again_at_the_peaks_its_source_bounds_its_gpu_by(monkeypatch) -> None:
    """bench/published.py's `lower`: the run planned on the datasheet's GPU, and again with the
    peaks its source bounds its GPU by, that prediction in the row's note."""
    from scaletrain.bench import published
    from scaletrain.bench.clock_recorded import compare_published, predict

    half = published.Peaks(989e12 / 2, 1979e12 / 2, 3.35e12 / 2, "half the SXM's peaks")
    shape = ("model.preset=1b", "precision=bf16", "parallel.strategy=fsdp", "data.seq_len=2048", "train.micro_batch=16")
    run = published.Published("a source", "1b", 8, 10_000.0, 128, 2048, (*shape, "train.global_batch=128"), 80, "", half)
    monkeypatch.setattr(published, "PUBLISHED", (run,))
    [row] = compare_published(lambda line: None)
    full = predict(run.overrides, "h100", 80 * 2**30, 8, 1).total
    low = predict(run.overrides, "h100", 80 * 2**30, 8, 1, peaks=half).total
    assert row.predicted_s == full and row.measured_s == run.step_s
    # Every rate halved: the matmuls, attention and memory-bound work take twice as long; the
    # host's dispatch and the collectives' latency do not, so a step of 1b at 16 x 2048 tokens a
    # rank (its compute most of it; at 4 x 2048 the fallback's 12 us of host per operation is a
    # third of it) takes well over 1.5x and at most 2x as long.
    assert 1.5 * full < low <= 2 * full
    [note] = [n for n in row.notes if "half the SXM's" in n]
    assert note.startswith("1b: at half the SXM's peaks: ") and note.endswith(f" ({low / run.step_s - 1:+.1%})")
