"""checkpoint.hf_every and checkpoint.hf_last (training/saves.py): Hugging Face weights
written during training, on a torch engine and on DeepSpeed, are `ckpt export` of the
checkpoint of that step byte for byte, and load in transformers."""

from __future__ import annotations

import pytest
import torch

from scaletrain.telemetry.metrics import read_metrics

from helpers.launch import check, scaletrain, train
from helpers.runs import STDLIB, base_overrides


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_hugging_face_weights_during_training_are_the_export_of_that_step(small_dataset, tmp_path, strategy):
    run = tmp_path / "run"
    extra = [f"parallel.strategy={strategy}", "checkpoint.every=4", "checkpoint.hf_every=3", "checkpoint.hf_last=true",
             "eval.every=0"]  # fmt: skip
    check(train([*base_overrides(small_dataset, run, steps=7), *extra], nproc=2))
    hf = run / "hf"
    # Steps 3 and 6 (hf_every: their checkpoints written for it) and 7 (hf_last, the end).
    assert sorted(p.name for p in hf.iterdir()) == ["step_3", "step_6", "step_7"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_4", "step_6", "step_7"]
    events = [r for r in read_metrics(run / "metrics.jsonl", events=True) if r.get("event") == "hf_export"]
    assert [r["step"] for r in events] == [3, 6, 7] and all(r["bytes"] > 0 for r in events)
    for step in (6, 7):
        out = tmp_path / f"export_{step}"
        check(scaletrain(["ckpt", "export", str(run / "checkpoints" / f"step_{step}"), str(out)]))
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in (hf / f"step_{step}").iterdir())
        for f in out.iterdir():
            assert (hf / f"step_{step}" / f.name).read_bytes() == f.read_bytes(), (step, f.name)
    # transformers loads one, with the run's tokenizer, and the trained model's loss is
    # below the untrained one's (ln 512 = 6.24 for this vocabulary).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(hf / "step_7"), dtype=torch.float32)
    ids = torch.tensor(
        [AutoTokenizer.from_pretrained(str(hf / "step_7")).encode((STDLIB / "json" / "decoder.py").read_text())[:64]]
    )
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert 0 < loss < 6.0
