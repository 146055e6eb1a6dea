"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest

from train_helpers import SMALL_CORPUS, base_overrides, check, run_scaletrain


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory):
    """A small corpus (three stdlib packages) prepared once per session, vocab 512."""
    out = tmp_path_factory.mktemp("shared-data") / "small"
    check(run_scaletrain(["data", "prepare", "--input", *SMALL_CORPUS, "--out", str(out), "--vocab-size", "512"]))
    return out


@pytest.fixture(scope="session")
def reference_run(small_dataset, tmp_path_factory):
    """One process, ddp, global batch 4, 10 fp32 steps: what every engine at world 2
    (2 ranks x micro-batch 2) must reproduce. Returns the run directory."""
    run = tmp_path_factory.mktemp("reference") / "ddp"
    check(run_scaletrain(["train", *base_overrides(small_dataset, run), "train.micro_batch=4"]))
    return run
