"""The bench's own runs of `python -m scaletrain ...` (bench/forked_runs.py): forked from a
server that has done their imports, each what a new process would be: its exit code, its
output in its log, the environment as it is when it starts; a new process wherever a fork
could differ."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from scaletrain.bench import forked_runs
from scaletrain.bench.runner import run_logged
from scaletrain.errors import UserError

pytestmark = pytest.mark.e2e

TRAIN = ["train", "model.preset=tiny", "data.seq_len=32", "train.micro_batch=1", "train.steps=2", "run.device=cpu"]


def test_a_forked_run_has_its_exit_code_its_log_and_the_environment_of_now(tmp_path, monkeypatch):
    log = tmp_path / "ok.log"
    assert forked_runs.run([*TRAIN, f"run.dir={tmp_path / 'ok'}"], log) == 0
    assert (tmp_path / "ok" / "checkpoints" / "step_2").is_dir() and "config" in log.read_text()
    # Forked: the server that did the imports is up, and nothing else of this process changed.
    import multiprocessing.forkserver as server

    assert server._forkserver._forkserver_pid is not None  # type: ignore[attr-defined]
    # scaletrain's own variables reach the fork as they are now: the fault injection kills
    # the run after its first step (SIGKILL, as an OOM killer would).
    monkeypatch.setenv("SCALETRAIN_KILL_AT", "step:1")
    assert forked_runs.run([*TRAIN, f"run.dir={tmp_path / 'killed'}"], tmp_path / "killed.log") == -signal.SIGKILL
    monkeypatch.delenv("SCALETRAIN_KILL_AT")
    # Bad input: the CLI's one line in the log and its exit code, which the bench reports.
    with pytest.raises(UserError, match=r"exit 2\): scaletrain: error: config key model.preset = 'nope' is invalid"):
        run_logged([sys.executable, "-m", "scaletrain", "train", "model.preset=nope"], tmp_path / "bad.log", "the bad run")


def test_where_a_fork_could_differ_the_command_is_a_new_process(tmp_path, monkeypatch):
    forked_runs.run(["--version"], tmp_path / "version.log")  # the server up, with today's environment
    # A variable read at import (the kernel family) differs from the server's: not forked.
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert forked_runs.run([*TRAIN, f"run.dir={tmp_path / 'a'}"], tmp_path / "a.log") is None
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    # Another working directory, likewise.
    here = os.getcwd()
    monkeypatch.chdir(tmp_path)
    assert forked_runs.run(["--version"], tmp_path / "b.log") is None
    monkeypatch.chdir(here)
    # `python -c`: multiprocessing cannot import such a __main__ again in the fork.
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
    monkeypatch.setattr(sys.modules["__main__"], "__file__", "<string>", raising=False)
    assert forked_runs.run(["--version"], tmp_path / "c.log") is None
