"""Checkpoint directory policy: completion marker, newest complete, keep-last-k pruning."""

import pytest
import torch
from torch import nn

from scaletrain import checkpoint
from scaletrain.launch.distributed import World

from helpers.runs import trainer_state

pytestmark = pytest.mark.unit


def fake_checkpoint(root, step, complete=True):
    d = checkpoint.step_dir(root, step)
    (d / "state").mkdir(parents=True)
    if complete:
        (d / checkpoint.MARKER).write_text("{}")
    return d


def test_incomplete_checkpoint_is_ignored(tmp_path):
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 20, complete=False)  # a save cut short by a kill
    assert checkpoint.latest_complete(tmp_path) == tmp_path / "step_10"
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path)] == [10]


def test_steps_sort_numerically_not_lexically(tmp_path):
    for s in (9, 10, 100):
        fake_checkpoint(tmp_path, s)
    assert checkpoint.latest_complete(tmp_path).name == "step_100"


def test_prune_keeps_newest_k_and_drops_stale_incomplete(tmp_path):
    for s in (10, 20, 30, 40):
        fake_checkpoint(tmp_path, s)
    fake_checkpoint(tmp_path, 15, complete=False)
    fake_checkpoint(tmp_path, 50, complete=False)  # newer than the kept ones: maybe being written now
    checkpoint.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_30", "step_40", "step_50"]


def test_save_load_round_trip_restores_state_and_rng(tmp_path):
    world = World(0, 1, 0, torch.device("cpu"), None)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    torch.manual_seed(7)
    path = checkpoint.step_dir(tmp_path, 1)
    from scaletrain.engines.torch_engine import load_dcp, save_dcp

    checkpoint.save_checkpoint(
        path,
        world,
        lambda d: save_dcp(model, opt, d),
        trainer_state(step=1),
        {"config.yaml": "x: 1\n"},
    )
    expected_draw = torch.rand(3)
    assert checkpoint.is_complete(path)
    assert (path / "config.yaml").read_text() == "x: 1\n"

    fresh = nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    torch.manual_seed(99)
    loaded = checkpoint.load_checkpoint(path, world, lambda d: load_dcp(fresh, fresh_opt, d / "state"))
    assert loaded.step == 1
    assert torch.equal(torch.rand(3), expected_draw)  # RNG continues where the save left it
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)

    weights = checkpoint.read_model_weights(path)
    assert set(weights) == {"weight", "bias"}
    assert torch.equal(weights["weight"], model.weight) and torch.equal(weights["bias"], model.bias)


def test_fault_points_parse_and_refuse_bad_values():
    from scaletrain.errors import UserError
    from scaletrain.resilience import faults

    assert faults.parse("") == []
    assert faults.parse("save:12") == [("save", 12, None)]
    # One fault per elastic attempt, optionally on one rank.
    assert faults.parse("step:3@1,term:8") == [("step", 3, 1), ("term", 8, None)]
    for bad in ("save", "save:0", "boom:3", "step:x", "step:3@x"):
        with pytest.raises(
            UserError,
            match=r"SCALETRAIN_KILL_AT=.* accepted: POINT:STEP\[@RANK\|@groupG\]\[,...\] with POINT one of step, down, save, upload, prune, metrics, term",
        ):
            faults.parse(bad)
