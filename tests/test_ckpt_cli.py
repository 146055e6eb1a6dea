"""`scaletrain ckpt inspect | verify | convert` as a user runs them."""

from __future__ import annotations

import json

import pytest
import torch

from scaletrain.checkpoint import read_model_weights

from helpers import check, one_line_error, scaletrain

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_convert_to_zero3_keeps_weights_moments_and_data_position(reference_run, tmp_path):
    src, dst = reference_run / "checkpoints" / "step_5", tmp_path / "z3" / "checkpoints" / "step_5"
    proc = check(scaletrain(["ckpt", "convert", str(src), str(dst), "--to", "zero3"]))
    assert "verified" in proc.stdout and f"train.resume={dst}" in proc.stdout
    info = json.loads(check(scaletrain(["ckpt", "inspect", str(dst), "--json"])).stdout)
    saved = json.loads((src / "trainer.json").read_text())
    assert (info["engine"], info["format"], info["world_size"]) == ("zero3", "deepspeed", 1)
    assert (info["step"], info["data_position"], info["tokens_seen"]) == (5, saved["data_position"], saved["tokens_seen"])
    assert "ok," in check(scaletrain(["ckpt", "verify", str(dst)])).stdout
    # DeepSpeed's own reader gives back exactly the fp32 weights that went in.
    a, b = read_model_weights(src), read_model_weights(dst)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Nothing is overwritten.
    one_line_error(scaletrain(["ckpt", "convert", str(src), str(dst), "--to", "fsdp"]), "already exists")


@pytest.mark.timeout(120)
def test_verify_names_a_damaged_file_in_one_line(reference_run, tmp_path):
    import shutil

    ckpt = tmp_path / "step_10"
    shutil.copytree(reference_run / "checkpoints" / "step_10", ckpt)
    (ckpt / "trainer.json").write_text((ckpt / "trainer.json").read_text().replace('"step": 10', '"step": 11'))
    one_line_error(scaletrain(["ckpt", "verify", str(ckpt)]), "trainer.json", "damaged")
