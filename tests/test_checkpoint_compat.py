"""Checkpoints written by an earlier scaletrain still resume, bit for bit.

tests/fixtures/main_step2 holds the checkpoint of step 2 of a tiny 4-step run, written by
main before trainer.json became a versioned TrainerState (the commit is in its
expected.json), with what the uninterrupted run logged after step 2 and the digest of every
tensor it held at step 4. Resuming that checkpoint with this version must give the same
losses, gradient norms and learning rates, as the same floats, and the same tensors.

Bit-exact on the x86-64 CPUs it was checked on: the fixture was made, and is resumed, with
ATen's portable kernels, MKL's reproducible path and one thread (make.sh says why); under avx2
and avx512 kernels without those pins its step-4 weights differed. Not on every CPU: on a
Sapphire Rapids machine (AMX, 2026-11-29) the resume gave the same losses and step 3's gradient
norm to the bit, and step 4's norm one fp32 ulp off (1.552952528 for 1.552952647), the commits
before this session's too, whatever oneDNN's ISA or MKL's instruction set was pinned to. So
where step 4 rounds differently the rows are held to 4 ulps (a norm over 81 tensors summed in
another order: a few ulps; a lost optimizer state or schedule moves step 4's loss by percents)
and the final tensors, whose hashes cannot be near, are not compared.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from scaletrain.telemetry import read_metrics

from helpers.launch import check, train

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "main_step2"
PINNED = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"}


def _digest_module():
    spec = importlib.util.spec_from_file_location("fixture_digest", FIXTURE / "digest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e
def test_a_checkpoint_of_main_before_trainer_state_resumes_bit_exactly(tmp_path):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    step = expected["checkpoint_step"]
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(FIXTURE / f"step_{step}", run / "checkpoints" / f"step_{step}")
    overrides = (FIXTURE / "overrides.txt").read_text().split()
    proc = check(train([*overrides, f"data.paths={FIXTURE / 'data'}", f"run.dir={run}", "train.resume=auto"], env=PINNED))
    assert f"step_{step}" in proc.stdout  # it resumed, not started afresh

    digest = _digest_module()
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]  # this run's: the steps after the checkpoint
    got_rows = [{k: r[k] for k in digest.FIELDS} for r in rows]
    if got_rows != expected["rows"]:  # a CPU that rounds otherwise (module docstring)
        assert [(r["step"], r["lr"], r["tokens"]) for r in got_rows] == [
            (r["step"], r["lr"], r["tokens"]) for r in expected["rows"]
        ]
        for got_row, want in zip(got_rows, expected["rows"], strict=True):
            for key in ("loss", "grad_norm"):
                assert got_row[key] == pytest.approx(want[key], rel=4 * 2**-23), (got_row, want)
        return
    final = expected["rows"][-1]["step"]
    got = digest.state_digests(run / "checkpoints" / f"step_{final}" / "state")
    assert got.keys() == expected["final_state"].keys()
    differ = [k for k in got if got[k] != expected["final_state"][k]]
    assert not differ, f"{len(differ)} of {len(got)} tensors differ at step {final}, e.g. {differ[:3]}"
