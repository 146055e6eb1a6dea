"""`scaletrain ckpt inspect | verify | convert` as a user runs them."""

from __future__ import annotations

import json

import pytest
import torch

from scaletrain.checkpoint import read_model_weights
from scaletrain.cli import main

from helpers.launch import check, scaletrain

pytestmark = pytest.mark.e2e


def cli(capsys, *args):
    """`scaletrain ARGS` in this process (no start-up cost): (exit code, stdout, stderr)."""
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.timeout(300)
def test_convert_to_zero3_keeps_weights_moments_and_data_position(reference_run, tmp_path, capsys):
    src, dst = reference_run / "checkpoints" / "step_5", tmp_path / "z3" / "checkpoints" / "step_5"
    proc = check(scaletrain(["ckpt", "convert", str(src), str(dst), "--to", "zero3"]))
    assert "verified" in proc.stdout and f"train.resume={dst}" in proc.stdout
    code, out, _ = cli(capsys, "ckpt", "inspect", str(dst), "--json")
    info, saved = json.loads(out), json.loads((src / "trainer.json").read_text())
    assert code == 0 and (info["engine"], info["format"], info["world_size"]) == ("zero3", "deepspeed", 1)
    assert (info["step"], info["data_position"], info["tokens_seen"]) == (5, saved["data_position"], saved["tokens_seen"])
    code, out, _ = cli(capsys, "ckpt", "verify", str(dst))
    assert code == 0 and "ok," in out
    # DeepSpeed's own reader gives back exactly the fp32 weights that went in.
    a, b = read_model_weights(src), read_model_weights(dst)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(120)
def test_damaged_file_and_existing_target_are_one_line_errors(reference_run, tmp_path, capsys):
    import shutil

    ckpt = tmp_path / "step_10"
    shutil.copytree(reference_run / "checkpoints" / "step_10", ckpt)
    (ckpt / "trainer.json").write_text((ckpt / "trainer.json").read_text().replace('"step": 10', '"step": 11'))
    code, _, err = cli(capsys, "ckpt", "verify", str(ckpt))
    assert code == 2 and err.count("\n") == 1 and "trainer.json does not match its checksum" in err and "damaged" in err
    code, _, err = cli(capsys, "ckpt", "convert", str(reference_run), str(ckpt), "--to", "fsdp")
    assert code == 2 and "already exists" in err  # nothing is overwritten
