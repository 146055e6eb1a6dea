"""Engine-neutral state: every engine's state_dict has the same plain-named layout and,
after the same first step, the same values; any engine loads any engine's exactly."""

from __future__ import annotations

import pytest
import torch

from helpers.launch import probe
from helpers.numerics import assert_weights_close

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]


@pytest.fixture(scope="module")
def states(tmp_path_factory):
    out = tmp_path_factory.mktemp("neutral")
    probe("neutral_state", [], out, nproc=2, timeout=300)
    return torch.load(out / "states.pt", weights_only=True)


def test_every_engine_gives_the_same_layout_and_values(states):
    ref = states["trained"]["ddp"]
    assert any(k.endswith(".exp_avg") for k in ref["optim"]) and "output.weight" in ref["model"]
    for engine, state in states["trained"].items():
        assert state["model"].keys() == ref["model"].keys(), engine
        assert state["optim"].keys() == ref["optim"].keys(), engine
        # One AdamW step from the same initialization on the same batch: equal up to
        # rounding, and per tensor as the equivalence tests compare weights (helpers/numerics.py).
        assert_weights_close(state["model"], ref["model"])
        for key, value in ref["optim"].items():
            got = state["optim"][key]
            if key.endswith(".exp_avg") or key.endswith(".exp_avg_sq"):
                # The moments are (1 - beta) g and (1 - beta2) g^2 of gradients that agree
                # elementwise to 1e-5 of the tensor's largest (test_gradients.py).
                torch.testing.assert_close(
                    got,
                    value,
                    rtol=1e-5,
                    atol=1e-5 * value.abs().max().item(),
                    msg=lambda m, where=f"{engine} {key}": f"{where}: {m}",
                )
            elif isinstance(value, torch.Tensor):
                assert torch.equal(got, value), (engine, key)  # the step count
            else:
                assert got == value, (engine, key, got, value)  # group settings


def test_any_engine_loads_any_engines_state_exactly(states):
    assert len(states["loaded"]) == 5
    for engine, (source, state) in states["loaded"].items():
        want = states["trained"][source]
        assert state["model"].keys() == want["model"].keys() and state["optim"].keys() == want["optim"].keys()
        for part in ("model", "optim"):
            for key, value in want[part].items():
                got = state[part][key]
                same = torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
                assert same, f"{source} -> {engine}: {part} {key}"
