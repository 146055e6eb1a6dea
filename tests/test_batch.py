"""The global batch that stays put (config/batch.py) and the planner's micro-batch search: which
micro-batches a run may take, and that a plan that does not fit at the configured one
finds one that does at the same global batch."""

from __future__ import annotations

import pytest

from scaletrain.config import AUTO_MICRO_BATCH, load_config
from scaletrain.config.batch import micro_batches, settle, with_micro_batch
from scaletrain.errors import UserError
from scaletrain.planning import make_plan, planning_spec
from scaletrain.planning.hardware import gpu
from scaletrain.planning.memory import estimate
from scaletrain.planning.planner import at_micro_batch
from scaletrain.resilience.faults import parse

pytestmark = pytest.mark.unit


def test_without_a_global_batch_it_is_micro_batch_x_grad_accum_x_dp():
    cfg = settle(load_config([], ["train.micro_batch=4", "train.grad_accum=3"]), dp=2)
    assert (cfg.train.global_batch, cfg.train.micro_batch, cfg.train.grad_accum) == (24, 4, 3)


def test_with_a_global_batch_grad_accum_follows_from_the_micro_batch():
    cfg = settle(load_config([], ["train.global_batch=64", "train.micro_batch=4"]), dp=4)
    assert cfg.train.grad_accum == 4
    smaller = with_micro_batch(cfg, 4, 2, "test")
    assert (smaller.train.micro_batch, smaller.train.grad_accum, smaller.train.global_batch) == (2, 8, 64)
    # A layout with fewer data-parallel ranks (tp 2) accumulates more at the same global batch.
    assert with_micro_batch(cfg, 2, 4, None).train.grad_accum == 8


@pytest.mark.parametrize(
    "overrides, dp, fragments",
    [
        (["train.global_batch=10", "train.micro_batch=1"], 4, ["train.global_batch=10", "4 data-parallel ranks", "8 or 12"]),
        (["train.global_batch=12", "train.micro_batch=4"], 2, ["train.micro_batch=4 does not divide the 6", "6, 3, 2, 1"]),
        (["train.global_batch=16", "train.micro_batch=2", "train.grad_accum=2"], 2, ["train.grad_accum=2 disagrees", "= 4"]),
    ],
)
def test_a_batch_that_does_not_divide_is_one_line_naming_what_would(overrides, dp, fragments):
    with pytest.raises(UserError) as err:
        settle(load_config([], overrides), dp)
    assert "\n" not in str(err.value)
    assert all(f in str(err.value) for f in fragments), str(err.value)


def test_micro_batches_are_the_divisors_a_pipeline_schedule_takes():
    assert micro_batches(12) == [12, 6, 4, 3, 2, 1]
    # 1f1b on 4 stages needs at least 4 micro-batches per step: micro-batch <= 12 / 4.
    assert micro_batches(12, pp=4, schedule="1f1b") == [3, 2, 1]


def test_auto_is_written_as_auto_and_needs_a_global_batch():
    cfg = load_config([], ["train.micro_batch=auto", "train.global_batch=32"])
    assert cfg.train.micro_batch == AUTO_MICRO_BATCH
    assert "micro_batch: auto" in cfg.to_yaml()


def test_oom_is_a_fault_point():
    assert parse("oom:3@1") == [("oom", 3, 1)]


def _plan(*overrides: str, gpus: int = 8, nodes: int = 1, memory: str = "80GiB", **kw):
    cfg = load_config([], ["precision=bf16", *overrides])
    return make_plan(cfg, planning_spec(cfg), gpus * nodes, nodes, gpu("h100", memory), **kw)


def test_405b_that_fits_nowhere_at_micro_batch_16_gets_a_layout_at_a_smaller_one():
    # The example: at micro-batch 16 even fsdp + tp 8 + AC needs 126 GiB per device.
    plan = _plan("model.preset=405b", "data.seq_len=8192", "parallel.strategy=auto", nodes=16)
    s = plan.chosen.setup
    assert plan.chosen.fits and s.micro_batch < 16
    assert s.micro_batch * s.grad_accum * s.dp == 16 * 128  # the global batch is the configured one
    assert f"fits with train.micro_batch={s.micro_batch}, train.grad_accum={s.grad_accum}" in " ".join(plan.reasons)
    assert plan.as_dict()["micro_batch"] == s.micro_batch


def test_a_named_strategy_that_does_not_fit_says_which_micro_batch_would():
    plan = _plan("model.preset=8b", "data.seq_len=4096", "parallel.strategy=fsdp", "train.micro_batch=16", as_configured=True)
    assert not plan.chosen.fits and plan.chosen.setup.micro_batch == 16  # planned as asked
    smaller = plan.chosen.smaller
    assert smaller is not None and smaller.fits and smaller.setup.micro_batch < 16
    assert f"fits with train.micro_batch={smaller.setup.micro_batch}" in " ".join(plan.reasons)
    # The largest that fits: the next larger micro-batch does not.
    bigger = at_micro_batch(smaller.setup, smaller.setup.micro_batch * 2)
    assert estimate(planning_spec(load_config([], ["model.preset=8b"])), bigger).peak > plan.usable


def test_auto_takes_the_largest_micro_batch_that_fits_each_layout():
    plan = _plan("model.preset=1b", "data.seq_len=2048", "train.micro_batch=auto", "train.global_batch=512")
    s = plan.chosen.setup
    assert plan.chosen.fits and 1 <= s.micro_batch < 64 and s.micro_batch * s.grad_accum * s.dp == 512
    assert plan.batch_choice.startswith(f"train.micro_batch=auto -> {s.micro_batch}")
    model = planning_spec(load_config([], ["model.preset=1b"]))
    next_up = next(b for b in range(s.micro_batch + 1, 65) if 64 % b == 0)
    assert estimate(model, at_micro_batch(s, next_up)).peak > plan.usable


def test_nothing_fits_even_at_micro_batch_1_names_the_devices_that_would():
    with pytest.raises(UserError) as err:
        _plan("model.preset=405b", "data.seq_len=8192", "parallel.strategy=auto", gpus=8, memory="24GiB")
    message = str(err.value)
    assert "even at train.micro_batch=1" in message and "closest feasible" in message, message
