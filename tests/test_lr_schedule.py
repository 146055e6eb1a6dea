"""The LR schedules (train.schedule) as pure functions of the step: warmup, then cosine,
linear, constant or warmup-stable-decay."""

import math
import re

import pytest

from scaletrain.config import TrainConfig, load_config
from scaletrain.errors import UserError
from scaletrain.optim.schedule import lr_at

pytestmark = pytest.mark.unit


def test_warmup_is_linear_then_cosine_reaches_the_floor():
    cfg = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    warm = [lr_at(s, cfg) for s in range(10)]
    assert warm == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lr_at(10, cfg) == pytest.approx(1.0)  # decay starts at the peak
    decay = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert lr_at(110, cfg) == pytest.approx(0.1)
    mid = 10 + 50
    assert lr_at(mid, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


def test_no_warmup_starts_at_peak():
    cfg = TrainConfig(steps=5, warmup_steps=0, lr=0.5, min_lr_ratio=0.0)
    assert lr_at(0, cfg) == pytest.approx(0.5)
    assert lr_at(5, cfg) == pytest.approx(0.0, abs=1e-12)


def test_linear_and_constant_after_the_same_warmup():
    linear = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, schedule="linear")
    constant = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, schedule="constant")
    for s in range(10):  # the warmup is every schedule's
        assert lr_at(s, linear) == lr_at(s, constant) == pytest.approx((s + 1) / 10)
    # Linear: the floor plus what is left of (peak - floor), by the same progress as cosine's.
    assert [lr_at(s, linear) for s in (10, 35, 60, 110)] == pytest.approx([1.0, 0.1 + 0.9 * 0.75, 0.55, 0.1])
    assert all(lr_at(s, constant) == 1.0 for s in range(10, 200))


@pytest.mark.parametrize("shape", ["1-sqrt", "linear"])
def test_wsd_holds_the_peak_until_its_decay_and_its_stable_phase_does_not_depend_on_the_steps(shape):
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.0, schedule="wsd", decay_steps=20, decay_shape=shape)
    assert [lr_at(s, cfg) for s in range(10, 80)] == [1.0] * 70  # stable: exactly the peak
    # The decay over the last 20 steps: progress p = (step - 80) / 20, what is left 1 - sqrt(p) or 1 - p.
    left = (lambda p: 1 - math.sqrt(p)) if shape == "1-sqrt" else (lambda p: 1 - p)
    assert [lr_at(s, cfg) for s in range(80, 100)] == pytest.approx([left((s - 80) / 20) for s in range(80, 100)])
    assert lr_at(100, cfg) == pytest.approx(0.0, abs=1e-12)
    # A longer run of the same schedule is the same run up to its own decay: extending a run
    # from a stable-phase checkpoint changes nothing before it (cosine's whole shape moves).
    longer = cfg.model_copy(update={"steps": 300})
    assert [lr_at(s, longer) for s in range(80)] == [lr_at(s, cfg) for s in range(80)]
    cosine = TrainConfig(steps=100, warmup_steps=10, lr=1.0)
    assert lr_at(50, cosine) != lr_at(50, cosine.model_copy(update={"steps": 300}))


def test_wsd_decays_over_a_fifth_of_the_run_unless_told():
    cfg = TrainConfig(steps=300, warmup_steps=10, lr=1.0, schedule="wsd")
    assert lr_at(239, cfg) == 1.0 and lr_at(240, cfg) == 1.0 and lr_at(241, cfg) < 1.0  # 60 steps of decay: 240..299


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["train.decay_steps=10"], "train.decay_steps is the length of wsd's decay, and train.schedule=cosine has none"),
        (["train.schedule=wsd", "train.steps=50", "train.warmup_steps=20", "train.decay_steps=31"],
         "train.decay_steps=31 is longer than the 30 steps after the warmup"),
        (["train.schedule=exponential"], "train.schedule"),
    ],
)  # fmt: skip
def test_a_decay_that_does_not_fit_is_one_line(overrides, said):
    with pytest.raises(UserError, match=re.escape(said)) as err:
        load_config([], overrides)
    assert "\n" not in str(err.value)
