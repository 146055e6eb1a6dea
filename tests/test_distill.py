"""Distillation (model.teacher): the loss, the planner's teacher memory, the refusals, and a
killed run that resumes bit-exactly with the teacher rebuilt (it is in no checkpoint).
Training on ddp, fsdp and zero3 against one process, the teacher bit for bit unchanged
and sharded, is in tests/test_hf_models.py (it shares that module's probe runs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scaletrain.checkpoint.formats import read_model_weights
from scaletrain.config import load_config
from scaletrain.errors import UserError
from scaletrain.models import distill_spec, model_spec
from scaletrain.models.distill import kl_to_teacher
from scaletrain.planning.memory import Setup, estimate
from scaletrain.telemetry.metrics import read_metrics

from helpers.launch import check, train
from helpers.numerics import assert_bit_exact, assert_same_training
from helpers.runs import (
    base_overrides,
    checkpoint_model,
    copy_until,
    dataset_windows,
    eval_overrides,
    eval_rows,
    loss_of,
    run_info,
    trainer_state,
)

TEACHER = ["model.teacher.preset=tiny", "model.teacher.n_layers=3"]


@pytest.mark.unit
def test_the_loss_is_the_temperature_scaled_kl_mixed_with_the_cross_entropy():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g) * 3
    targets = torch.randint(0, 11, (2, 5), generator=g)
    # The definition in float64: sum_v p_t (log p_t - log p_s) at temperature T, mean over positions.
    t = 2.0
    p_t = F.softmax(teacher.double() / t, -1)
    want_kl = (p_t * (p_t.log() - F.log_softmax(student.double() / t, -1))).sum(-1).mean()
    # fp32 against float64 over 11 terms of size ~1: a few fp32 ulps.
    torch.testing.assert_close(kl_to_teacher(student, teacher, t).double(), want_kl, rtol=1e-5, atol=1e-6)
    assert kl_to_teacher(teacher, teacher, t).abs() < 1e-6  # no distance to itself

    cfg = load_config([], ["model.vocab_size=11", *TEACHER, "model.teacher.temperature=2", "model.teacher.kl_weight=0.25"])
    distill = distill_spec(cfg, model_spec(cfg, 11))
    ce = F.cross_entropy(student.reshape(-1, 11), targets.reshape(-1))
    got = distill.loss((student, teacher), targets)
    torch.testing.assert_close(got, 0.25 * t * t * kl_to_teacher(student, teacher, t) + 0.75 * ce)
    # Gradients reach the student's logits only.
    s = student.clone().requires_grad_()
    distill.loss((s, teacher), targets).backward()
    assert s.grad is not None and s.grad.abs().sum() > 0


@pytest.mark.unit
def test_the_hidden_state_term_is_the_projected_students_squared_error_to_the_teacher():
    # A 32-wide student, a 64-wide teacher: the student gains distill_proj (32 -> 64), trained
    # even where model.trainable freezes the rest, and the loss adds hidden_weight x the mean
    # squared error between its final norm's output, projected, and the teacher's.
    overrides = ["model.vocab_size=11", "model.dim=32", "model.trainable=['norm.weight']", *TEACHER,
                 "model.teacher.dim=64", "model.teacher.hidden_weight=0.5"]  # fmt: skip
    cfg = load_config([], overrides)
    spec = model_spec(cfg, 11)
    distill = distill_spec(cfg, spec)
    student, teacher = spec.build_meta(8), distill.teacher.build_meta(8)
    spec.materialize(student, torch.device("cpu"), 0)
    distill.teacher.materialize(teacher, torch.device("cpu"), 1)
    assert student.distill_proj.weight.shape == (64, 32) and student.distill_proj.weight.requires_grad
    assert spec.counts().total - spec.inner.counts().total == 64 * 32  # the planner counts it
    assert spec.config()["distill_proj"] == [32, 64]
    seen = {}  # each final norm's output, by a hook of this test's own
    student.norm.register_forward_hook(lambda m, a, out: seen.__setitem__("student", out))
    teacher.norm.register_forward_hook(lambda m, a, out: seen.__setitem__("teacher", out))
    tokens = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        taught = teacher(tokens[:, :-1])
    output = student(tokens[:, :-1])
    loss = distill.loss((output, taught), tokens[:, 1:])
    projected = seen["student"] @ student.distill_proj.weight.T
    want = 1.0 * kl_to_teacher(output, taught, 1.0) + 0.5 * ((projected - seen["teacher"]) ** 2).mean()
    torch.testing.assert_close(loss, want)  # the same fp32 operations in another order: ulps
    loss.backward()
    assert student.distill_proj.weight.grad.abs().sum() > 0 and student.norm.weight.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in student.named_parameters() if n not in ("distill_proj.weight", "norm.weight"))


@pytest.mark.unit
def test_a_resume_with_or_without_the_hidden_state_term_against_its_checkpoint_is_refused(tmp_path):
    from scaletrain.checkpoint.resume import check_config

    with_term = load_config([], ["model.vocab_size=11", *TEACHER, "model.teacher.hidden_weight=1"])
    without = load_config([], ["model.vocab_size=11", *TEACHER])
    for saved, now, had in ((with_term, without, "with"), (without, with_term, "without")):
        (tmp_path / "config.yaml").write_text(saved.to_yaml())
        state = trainer_state(model=model_spec(saved, 11).config())
        with pytest.raises(UserError, match=f"trained {had} model.teacher.hidden_weight"):
            check_config(tmp_path, now, state, model_spec(now, 11).config(), "x")


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, message",
    [
        ([*TEACHER, "parallel.strategy=fsdp", "parallel.tp=2"], "model.teacher runs beside data-parallel engines only"),
        (["model.teacher.source=hf"], "model.teacher.source=hf needs exactly one of model.teacher.path"),
        (["model.teacher.path=/x"], "model.teacher.path is for Hugging Face models"),
        (["model.teacher.kl_weight=2"], "model.teacher.kl_weight"),
    ],
)
def test_a_teacher_that_cannot_work_is_refused_in_one_line(overrides, message):
    with pytest.raises(UserError, match=message.replace(".", r"\.")) as e:
        load_config([], overrides)
    assert "\n" not in str(e.value)


@pytest.mark.unit
def test_a_teacher_over_another_vocabulary_is_refused():
    cfg = load_config([], ["model.vocab_size=100", *TEACHER, "model.teacher.vocab_size=120"])
    with pytest.raises(UserError, match="model.teacher has a vocabulary of 120 tokens and the model 100"):
        distill_spec(cfg, model_spec(cfg, 100))


@pytest.mark.unit
@pytest.mark.parametrize("strategy, copies", [("ddp", 1.0), ("zero2", 1.0), ("fsdp", 0.25), ("zero3", 0.25)])
def test_the_planner_counts_the_teacher_as_each_engine_holds_it(strategy, copies):
    cfg = load_config([], ["model.preset=1b", "model.teacher.preset=8b", "precision=bf16"])
    student = model_spec(cfg, None)
    teacher = distill_spec(cfg, student).teacher
    s = Setup(strategy=strategy, dp=4, micro_batch=1, seq_len=1024, precision="bf16")
    alone, beside = estimate(student, s), estimate(student, Setup(**{**s.__dict__, "teacher": teacher}))
    # 2 bytes (bf16) a parameter on ddp / zero1-2 / zero3, fp32 shards on fsdp; 1/dp where sharded.
    per_param = 4.0 if strategy == "fsdp" else 2.0
    assert beside.params - alone.params == pytest.approx(per_param * teacher.counts().total * copies)
    assert beside.peak > alone.peak + per_param * teacher.counts().total * copies


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_killed_distillation_resumes_bit_exactly_and_its_checkpoints_hold_only_the_student(small_dataset, tmp_path):
    evaluated = eval_overrides(small_dataset, every=3)
    args = lambda run: [*base_overrides(small_dataset, run, steps=6), "checkpoint.every=3", *TEACHER, *evaluated]  # noqa: E731
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    check(train(args(straight)))
    # What a kill after step 4 leaves (real kills: test_train_equivalence.py), without its launch.
    copy_until(straight, killed, step=3)
    check(train(args(killed)))  # the teacher is rebuilt from the config: the same seeded weights
    assert run_info(killed)["resumed_from"].endswith("step_3")
    assert_bit_exact(killed, straight, 6)  # the evaluations of steps 3 and 6 included
    # What is evaluated is the student alone, by its cross entropy (no KL to the teacher):
    # its checkpoint's own loss on the eval windows (2 global batches of 16), computed here.
    windows = dataset_windows(small_dataset, 2 * 16, 64)
    assert eval_rows(straight)[-1]["loss"] == pytest.approx(
        loss_of(checkpoint_model(straight / "checkpoints" / "step_6", 64), windows), rel=1e-5
    )
    student = model_spec(load_config([], args(straight)), 512).build_meta(64)  # the data's vocabulary (conftest.py)
    assert set(read_model_weights(killed / "checkpoints" / "step_6")) == {
        n for n, _ in student.named_parameters(remove_duplicate=False)
    }


# A mixture of experts on either side (issue 40): the student's routers train through its
# auxiliary terms, added to the distillation loss as its own spec adds them; a teacher's
# terms are dropped. The default balance (sequence_aux) keeps the numbers to the global
# batch, so one process at micro-batch 8 is the reference for world 2 at 4 per rank.
MOE_PAIRS = {
    "moe-student-fsdp-ep2": (["model.preset=tiny-moe", *TEACHER], ["parallel.strategy=fsdp", "parallel.ep=2"]),
    "moe-teacher-zero2": (["model.teacher.preset=tiny-moe", "model.teacher.n_layers=2"], ["parallel.strategy=zero2"]),
}


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize("pair", list(MOE_PAIRS))
def test_a_mixture_of_experts_distils_and_teaches_at_world_2_as_in_one_process(small_dataset, tmp_path, pair):
    models, layout = MOE_PAIRS[pair]
    runs = {}
    for name, nproc, extra in (("w1", 1, ["train.micro_batch=8"]), ("w2", 2, ["train.micro_batch=4", *layout])):
        runs[name] = tmp_path / name
        args = [*base_overrides(small_dataset, runs[name], steps=8), *models, "model.teacher.kl_weight=0.5", *extra]
        check(train([*args, *eval_overrides(small_dataset)], nproc=nproc))
    # The standing tolerances (helpers/numerics.py): summation order only.
    assert_same_training(runs["w2"], runs["w1"], steps=8)
    if pair.startswith("moe-student"):  # its routers were trained: their load is in the interval rows
        intervals = [r for r in read_metrics(runs["w2"] / "metrics.jsonl", events=True) if r.get("event") == "interval"]
        assert intervals and all(len(r["moe"]["layers"]) == 4 for r in intervals)


@pytest.mark.unit
def test_the_students_routing_terms_reach_its_gradient_and_leave_the_loss_value():
    cfg = load_config([], ["model.vocab_size=11", "model.preset=tiny-moe", *TEACHER, "model.teacher.kl_weight=0.5"])
    distill = distill_spec(cfg, model_spec(cfg, 11))
    assert distill is not None
    logits, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    aux = torch.tensor(0.7, requires_grad=True)
    plain = distill.loss((logits, teacher), targets)
    with_aux = distill.loss(((logits, aux), (teacher, torch.tensor(5.0))), targets)
    assert torch.equal(with_aux, plain)  # the value: the distillation loss alone, the teacher's terms dropped
    with_aux.backward()
    assert aux.grad == 1.0  # the student's routers get the terms' gradient, once
