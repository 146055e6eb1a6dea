"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest

from train_helpers import SMALL_CORPUS, check, run_scaletrain


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory):
    """A small corpus (three stdlib packages) prepared once per session, vocab 512."""
    out = tmp_path_factory.mktemp("shared-data") / "small"
    check(run_scaletrain(["data", "prepare", "--input", *SMALL_CORPUS, "--out", str(out), "--vocab-size", "512"]))
    return out
