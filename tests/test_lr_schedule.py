"""Warmup + cosine schedule as a pure function of the step."""

import math

import pytest

from scaletrain.config import TrainConfig
from scaletrain.training.optim import lr_at

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
