"""checkpoint.async_save: the loop waits only for the copy; the files written in the background
hold the state of the step they belong to (not of a later one), exactly as a synchronous
save writes it; each save's blocking time is an event row in metrics.jsonl."""

from __future__ import annotations

import pytest

import scaletrain.trainer as trainer
from scaletrain import checkpoint
from scaletrain.checkpoint.restore import first_difference
from scaletrain.config import load_config
from scaletrain.telemetry import read_metrics
from test_nonfinite import state

from helpers import base_overrides, metric_rows

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_background_save_writes_the_state_of_its_step(small_dataset, tmp_path):
    runs = {}
    for mode in ("true", "false"):
        runs[mode] = run_dir = tmp_path / f"async_{mode}"
        overrides = [*base_overrides(small_dataset, run_dir, steps=4), "train.micro_batch=2", "checkpoint.every=1"]
        trainer.train(load_config([], [*overrides, "checkpoint.keep=4", f"checkpoint.async_save={mode}"]))
    background, synchronous = runs["true"], runs["false"]
    # Saved while the next steps already changed the weights: same bits as a save that waited.
    for step in (1, 2, 3, 4):
        assert checkpoint.find_problem(background / "checkpoints" / f"step_{step}", checkpoint.manager.ALONE) is None
        assert first_difference(state(background, step), state(synchronous, step)) is None, step
    assert [r["loss"] for r in metric_rows(background)] == [r["loss"] for r in metric_rows(synchronous)]
    for run_dir, is_async in ((background, True), (synchronous, False)):
        events = [r for r in read_metrics(run_dir / "metrics.jsonl", events=True) if r.get("event") == "checkpoint"]
        assert sorted(e["step"] for e in events) == [1, 2, 3, 4] and {e["async"] for e in events} == {is_async}
        assert all(0 < e["blocking_s"] <= e["total_s"] for e in events), events
