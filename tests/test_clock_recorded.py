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
