"""train.optimizer=schedule_free_adamw (optim/schedule_free.py, added through optim/registry.py):
its averaged weights are what evaluation sees and checkpoints hold, its state is what the
planner counts, ddp and fsdp at world 2 equal one process, a resume is bit for bit on the
same layout and within the standing tolerances from world 2 onto world 1, and where it is not
built the refusal is one line."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from scaletrain.config import load_config
from scaletrain.config.parallel import dims_for
from scaletrain.errors import UserError
from scaletrain.models import model_spec
from scaletrain.optim.optimizers import averaged, build_optimizer, decay_groups
from scaletrain.planning.memory import estimate
from scaletrain.planning.planner import setups_for
from scaletrain.planning.setup import Setup

from helpers.launch import check, one_line_error, train
from helpers.numerics import assert_bit_exact, assert_same_training
from helpers.runs import base_overrides, checkpoint_model, copy_until, dataset_windows, eval_overrides, eval_rows, loss_of

SF = ["train.optimizer=schedule_free_adamw"]
STEPS = 8


def _model(*overrides: str):
    cfg = load_config([], ["model.vocab_size=64", *SF, *overrides])
    spec = model_spec(cfg, 64)
    model = spec.build_meta(16)
    spec.materialize(model, torch.device("cpu"), seed=0)  # weights, buffers (rotary tables) and ties as in training
    return cfg, model


@pytest.mark.unit
def test_the_config_takes_a_constant_schedule_unless_told_and_refuses_in_one_line():
    assert load_config([], SF).train.schedule == "constant"  # its average replaces the decay
    assert load_config([], [*SF, "train.schedule=wsd"]).train.schedule == "wsd"  # one said is kept
    assert load_config([], []).train.schedule == "cosine"  # the others' default is untouched
    for overrides, said in (
        (["parallel.strategy=zero2"], "not with parallel.strategy=zero2 (DeepSpeed's ZeRO optimizer"),
        (["parallel.strategy=fsdp", "parallel.tp=2"], "not with parallel.tp=2 (not checked yet); accepted: parallel.tp=1"),
        (["train.optimizer=sgd"], "train.optimizer=sgd is not one scaletrain knows; accepted: adamw, muon or schedule_free"),
    ):
        with pytest.raises(UserError) as err:
            load_config([], [*SF, *overrides])
        assert said in str(err.value) and "\n" not in str(err.value)


@pytest.mark.unit
def test_a_missing_package_is_one_line(monkeypatch):
    cfg, model = _model()
    monkeypatch.setitem(sys.modules, "schedulefree", None)  # import schedulefree: ImportError
    with pytest.raises(UserError, match=r"needs the schedulefree package; accepted: pip install 'scaletrain\[schedule-free\]'"):
        build_optimizer(decay_groups(cfg.train)(model), cfg.train, torch.device("cpu"))


@pytest.mark.unit
def test_averaged_holds_x_and_gives_back_the_training_weights():
    """Around an evaluation or save the parameters hold x, the average; after it y again.
    Schedule-free's y = (1 - beta1) z + beta1 x (Defazio et al. 2024, eq. 1), so x is read
    back from y and z; the switch back is the package's interpolation, exact to a few ulps."""
    cfg, model = _model()
    opt = build_optimizer(decay_groups(cfg.train)(model), cfg.train, torch.device("cpu"))
    for _ in range(3):
        model.zero_grad()
        model(torch.randint(0, 64, (2, 16))).float().pow(2).mean().backward()
        opt.step()
    beta1 = cfg.train.adam_beta1
    params = [p for g in opt.param_groups for p in g["params"]]
    y = [p.detach().clone() for p in params]
    with averaged(opt):
        for p, yp in zip(params, y):
            x = (yp - (1 - beta1) * opt.state[p]["z"]) / beta1
            # |x| up to ~1e2 |y| where z is near y: fp32 rounding of the two lerps, 1e-5 relative.
            torch.testing.assert_close(p.detach(), x, rtol=1e-5, atol=1e-6)
        assert not any(g["train_mode"] for g in opt.param_groups)
    assert all(g["train_mode"] for g in opt.param_groups)
    for p, yp in zip(params, y):
        torch.testing.assert_close(p.detach(), yp, rtol=1e-5, atol=1e-6)
    assert not torch.equal(params[0].detach(), (y[0] - (1 - beta1) * opt.state[params[0]]["z"]) / beta1)  # x != y


@pytest.mark.unit
def test_the_plan_counts_its_state_as_the_optimizer_holds_it():
    """z and the second moment: 8 fp32 bytes per trained parameter, as AdamW's two moments,
    counted against the tensors a built optimizer holds after a step (the schedule-free
    package keeps no step tensor)."""
    cfg, model = _model()
    opt = build_optimizer(decay_groups(cfg.train)(model), cfg.train, torch.device("cpu"))
    model(torch.randint(0, 64, (2, 16))).float().pow(2).mean().backward()
    opt.step()
    held = sum(t.nbytes for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor))
    setup = replace(Setup.from_config(cfg, dims_for(cfg.parallel, 1)), strategy="ddp", precision="fp32")
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # a tied weight once
    assert estimate(model_spec(cfg, 64), setup).optimizer == held == 8 * trained
    planned = setups_for(load_config([], [*SF, "model.vocab_size=64", "parallel.strategy=auto"]), 4, 1, True, model_spec(cfg, 64))
    assert {s.strategy for s in planned} == {"ddp", "fsdp"} and {s.tp for s in planned} == {1}


def _args(data, run, micro_batch: int, *more: str) -> list[str]:
    return [*base_overrides(data, run, steps=STEPS), *SF, f"train.micro_batch={micro_batch}", "checkpoint.every=4",
            *eval_overrides(data), *more]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(small_dataset, tmp_path_factory):
    run = tmp_path_factory.mktemp("schedule-free") / "w1"
    check(train(_args(small_dataset, run, 8)))
    return run


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_evaluation_and_checkpoints_take_the_averaged_weights_and_a_resume_is_bit_exact(one_process, small_dataset, tmp_path):
    # The in-loop eval at step 8 is the loss of the model step_8 holds, over the same windows
    # (eval.data: the corpus's first windows in file order), to test_eval.py's 1e-5: the same
    # fp32 weights and windows, batched otherwise.
    row = next(r for r in eval_rows(one_process) if r["step"] == 8)
    windows = dataset_windows(small_dataset, row["tokens"] // 64, 64)
    assert row["loss"] == pytest.approx(loss_of(checkpoint_model(one_process / "checkpoints" / "step_8", 64), windows), rel=1e-5)
    saved = tmp_path / "step_8.pt"
    dcp_to_torch_save(one_process / "checkpoints" / "step_8" / "state", saved)
    optim = torch.load(saved, weights_only=False)["optim"]
    modes = {v for k, v in optim.items() if k.startswith("param_groups.") and k.endswith(".train_mode")}
    assert modes == {False}  # saved in its evaluation mode: the weights are x
    assert any(k.endswith(".z") for k in optim)
    # The same layout resumed from step 4: bit for bit (its load switches x back to y as the
    # straight run switched back after its save).
    resumed = tmp_path / "resumed"
    copy_until(one_process, resumed, 4)
    check(train(_args(small_dataset, resumed, 8)))
    assert_bit_exact(resumed, one_process, STEPS)
    # A checkpoint of another optimizer's run is not resumed as this one.
    one_line_error(train([*_args(small_dataset, resumed, 8), "train.optimizer=adamw", "train.steps=9"]), "train.optimizer is")


# World 2, 8 sequences a step as one process: 2 ranks x 4.
LAYOUTS = {"ddp": ["parallel.strategy=ddp"], "fsdp": ["parallel.strategy=fsdp"]}


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_world_2_equals_one_process_and_its_checkpoint_resumes_at_world_1(one_process, small_dataset, tmp_path, layout):
    w2 = tmp_path / "w2"
    check(train([*_args(small_dataset, w2, 4), *LAYOUTS[layout]], nproc=2))
    # The standing tolerances (helpers/numerics.py): the step is AdamW's element-wise
    # arithmetic on z and the second moment, the interpolations to y and x element-wise too,
    # so the ranks' gradients differ from one process's by summation order only.
    assert_same_training(w2, one_process, steps=STEPS)
    # N -> M: world 2's step 4 (fsdp: z and the moment resharded by DCP) continued by one process.
    moved = tmp_path / "moved"
    copy_until(w2, moved, 4)
    assert "resumed from step_4" in check(train(_args(small_dataset, moved, 8))).stdout
    assert_same_training(moved, one_process, steps=STEPS)
