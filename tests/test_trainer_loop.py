"""The loop knows no engine: per step it calls forward_backward and step, nothing else; and
what a run writes for machines (run.json) says what ran where."""

from __future__ import annotations

import pytest

import scaletrain.training.trainer as trainer
from scaletrain.config import load_config

from helpers.runs import base_overrides, run_info

pytestmark = pytest.mark.e2e


class Recording:
    """Stands in for the engine and records every method the trainer calls on it."""

    def __init__(self, engine, calls: list[str]):
        self._engine, self._calls = engine, calls

    def __getattr__(self, name):
        value = getattr(self._engine, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            self._calls.append(name)
            return value(*args, **kwargs)

        return call


@pytest.mark.timeout(300)
def test_forward_backward_and_step_are_all_the_loop_calls_per_step(small_dataset, tmp_path, monkeypatch):
    calls: list[str] = []
    build = trainer.build_engine
    monkeypatch.setattr(trainer, "build_engine", lambda *a, **k: Recording(build(*a, **k), calls))
    cfg = load_config(
        [],
        [
            *base_overrides(small_dataset, tmp_path / "run", steps=4),
            "train.micro_batch=2",
            "train.grad_accum=2",
            "train.log_every=1",
            "checkpoint.every=2",
        ],
    )
    trainer.train(cfg)
    loop = calls[calls.index("forward_backward") :]
    save = ["extra_state", "checkpoint_files", "save"]  # at the checkpoint steps, 2 and 4, only
    assert loop == ["forward_backward", "step", "forward_backward", "step", *save] * 2, calls

    info = run_info(tmp_path / "run")
    assert info["engine"] == "ddp" and info["world_size"] == 1 and info["backend"] is None and info["device"] == "cpu"
    assert info["parallel"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "dp_size": 1}
    assert len(info["hosts"]) == 1 and info["versions"]["scaletrain"] and info["resumed_from"] is None
    assert info["started"].endswith("+00:00")


@pytest.mark.timeout(300)
def test_the_engine_is_let_go_while_an_error_still_holds_the_run(small_dataset, tmp_path, monkeypatch):
    """The run is the engine's one holder (its checkpoints, evaluations and drills reach it
    through the run): an error's traceback keeps the Run alive, and a DDP wrapper kept with
    it would outlive the process group. So once train() has given up, nothing holds it."""
    import gc
    import weakref

    built: list[weakref.ref] = []
    build, step = trainer.build_engine, trainer.train_step

    def building(*a, **k):
        engine = build(*a, **k)
        built.append(weakref.ref(engine))
        return engine

    def failing(run):
        if run.step == 3:
            raise RuntimeError("planted: a step that fails")
        step(run)

    monkeypatch.setattr(trainer, "build_engine", building)
    monkeypatch.setattr(trainer, "train_step", failing)
    overrides = [
        *base_overrides(small_dataset, tmp_path / "run", steps=6),
        "checkpoint.every=2",
        "eval.every=2",
        "eval.split=0.3",
        "eval.batches=1",
    ]
    with pytest.raises(RuntimeError, match="planted") as error:
        trainer.train(load_config([], overrides))
    gc.collect()
    assert error.value.__traceback__ is not None  # the frames, the Run among them, are still held here
    assert len(built) == 1 and built[0]() is None
