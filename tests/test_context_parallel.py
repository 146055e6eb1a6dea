"""Context parallel (parallel.cp, models/context_parallel.py) in runs: fsdp at cp=2 equals
one process (loss and grad norm every step, eval rows, final weights), so do cp 2 x dp 2
and cp 2 x tp 2 at world 4 and ddp with activation checkpointing and the chunked loss; a
cp=2 checkpoint resumes at cp=1 and continues as the straight run; the planner offers cp
for long sequences; what does not combine is one line. Gradients after one backward (cp
on fsdp and ddp, with documents masked) are in test_gradients.py."""

from __future__ import annotations

import json

import pytest

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.models import PRESETS
from scaletrain.telemetry.profile import COMM_OP_PREFIXES, analyze_trace

from helpers.launch import check, train
from helpers.numerics import assert_same_training
from helpers.runs import CP_EVERY, CP_STEPS, base_overrides, cp_overrides, run_info, train_through


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_cp2_on_fsdp_is_one_process(small_dataset, cp_straight, tmp_path):
    # The acceptance's command: launch --nproc 2 ... parallel.strategy=fsdp parallel.cp=2.
    # Step 2 traced: the keys' and values' all-gathers are communication in its breakdown.
    cp2 = tmp_path / "cp2"
    extra = ["train.micro_batch=4", "parallel.strategy=fsdp", "parallel.cp=2", "telemetry.profile_steps=[2,2]"]
    check(train(cp_overrides(small_dataset, cp2, *extra), nproc=2))
    assert run_info(cp2)["parallel"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 1, "dp_size": 1}
    assert_same_training(cp2, cp_straight, steps=CP_STEPS)
    trace = cp2 / "profile" / "rank0.trace.json"
    names = [e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]]
    # Each block's keys and values: FSDP2 gathers through c10d directly, only cp through the functional collectives.
    gathers = 2 * PRESETS["tiny"]["n_layers"]
    assert names.count("_c10d_functional::all_gather_into_tensor") == gathers
    assert names.count("_c10d_functional::reduce_scatter_tensor") == gathers  # their backward
    assert all(
        n.startswith(COMM_OP_PREFIXES) for n in ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::wait_tensor")
    )
    assert analyze_trace(trace)["comm_s"] > 0


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_cp2_on_ddp_with_checkpointing_and_the_chunked_loss_resumes_at_cp1(small_dataset, cp_straight, tmp_path):
    # Steps 1-4 on ddp at cp=2, activation checkpointing recomputing each block's forward
    # (its key/value gathers with it) and the loss in chunks of each rank's logits; then
    # its checkpoint continued by one process on fsdp at cp=1: cp holds no state of its own.
    run = tmp_path / "run"
    cp2 = ["parallel.strategy=ddp", "parallel.cp=2", "train.micro_batch=2", "train.grad_accum=2"]
    cp2 += ["parallel.activation_checkpointing=true", "train.loss_chunk_tokens=96"]
    links = [
        (cp_overrides(small_dataset, run, *cp2), 2, "ddp at world 2 (cp 2)"),
        (cp_overrides(small_dataset, run, "train.micro_batch=4", "parallel.strategy=fsdp"), 1, "fsdp at world 1"),
    ]
    train_through(run, links, every=CP_EVERY)
    assert_same_training(run, cp_straight, steps=CP_STEPS)


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.strategy=fsdp", "parallel.cp=2", "train.micro_batch=2"],  # cp 2 x dp 2
        ["parallel.strategy=fsdp", "parallel.cp=2", "parallel.tp=2", "train.micro_batch=4"],  # cp 2 x tp 2
    ],
    ids=["cp2-dp2", "cp2-tp2"],
)
def test_cp2_at_world_4_is_one_process(small_dataset, cp_straight, tmp_path, layout):
    check(train(cp_overrides(small_dataset, tmp_path / "run", *layout), nproc=4))
    assert_same_training(tmp_path / "run", cp_straight, steps=CP_STEPS)


@pytest.mark.e2e
def test_what_does_not_combine_with_cp_is_one_line(small_dataset, tmp_path, capsys):
    base = ["train", f"run.dir={tmp_path / 'run'}", f"data.paths={small_dataset}", "run.device=cpu", "parallel.cp=2"]
    cases = {
        ("parallel.strategy=auto",): "parallel.cp=2 needs parallel.strategy=ddp, fsdp, zero1, zero2 or zero3, not auto",
        (
            "parallel.strategy=fsdp",
            "data.seq_len=102",
        ): "data.seq_len=102 does not divide; accepted: data.seq_len a multiple of 4",
        ("parallel.strategy=fsdp", "parallel.pp=2", "train.grad_accum=2"): "parallel.cp=2 does not combine with parallel.pp=2",
        ("parallel.strategy=fsdp", "model.moe={capacity_factor: 1.25}"): (
            "parallel.cp=2 does not combine with model.moe.capacity_factor=1.25 (a capacity counts each rank's part"
        ),
        ("parallel.strategy=fsdp", "model.source=hf", "model.hf_config={model_type: llama}"): (
            "parallel.cp=2 does not combine with model.source=hf"
        ),
        # Ulysses compiles (tests/test_gradients.py checks its gradients compiled); all-gather does not.
        ("parallel.strategy=fsdp", "train.compile=true"): (
            "parallel.cp=2 does not combine with train.compile=true (the all-gather design's chunked causal mask, a "
            "CausalBias, does not trace under torch.compile); accepted: train.compile=false, or parallel.cp_mode=ulysses, "
            "or parallel.cp=1"
        ),
    }
    for args, says in cases.items():
        assert main([*base, *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("scaletrain: error:") and says in err[0], err
    # plan --measure: Ulysses is measured (tests/test_plan_measure.py), the all-gather design is refused up front.
    assert main(["plan", "--measure", "run.device=cpu", "parallel.strategy=fsdp", "parallel.cp=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--measure does not support parallel.cp=2 with cp_mode=allgather" in err[0], err
    assert "accepted: parallel.cp_mode=ulysses, or parallel.cp=1" in err[0]


@pytest.mark.unit
def test_the_planner_offers_cp_for_long_sequences_and_says_why():
    from scaletrain.models import model_spec
    from scaletrain.planning import make_plan
    from scaletrain.planning.hardware import gpu

    cfg = load_config([], ["model.preset=8b", "data.seq_len=32768", "precision=bf16"])
    plan = make_plan(cfg, model_spec(cfg, None), 8, 1, gpu("h100", "80GiB"))
    assert plan.chosen.setup.cp > 1 and plan.chosen.fits
    said = " ".join(plan.reasons)
    assert f"cp={plan.chosen.setup.cp}: each rank holds" in said and "all-gathers the keys and values" in said
    # Activations and logits per rank shrink with cp: the same layout at cp 2, 4, 8.
    by_cp = {
        c.setup.cp: c.memory.activations for c in plan.candidates if c.setup.tp == 1 and not c.setup.activation_checkpointing
    }
    assert by_cp[8] < by_cp[4] < by_cp[2] < by_cp[1]
    short = load_config([], ["model.preset=8b", "data.seq_len=4096", "precision=bf16"])
    assert all(c.setup.cp == 1 for c in make_plan(short, model_spec(short, None), 8, 1, gpu("h100", None)).candidates)


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_cp2_with_lora_and_a_frozen_teacher_is_one_process(small_dataset, tmp_path):
    # The teacher holds the same chunks (its logits are the student's positions'), LoRA's
    # adapters sit in the attention's projections: both as in one process.
    extra = ["data.seq_len=128", "train.lr=1e-2", "train.micro_batch=4", "parallel.strategy=fsdp", "eval.every=0"]
    extra += ["model.lora={r: 4, alpha: 8}", "model.teacher={preset: tiny, kl_weight: 0.5}"]
    one, cp2 = tmp_path / "one", tmp_path / "cp2"
    check(train([*base_overrides(small_dataset, one, steps=6), *extra]))
    check(train([*base_overrides(small_dataset, cp2, steps=6), *extra, "parallel.cp=2"], nproc=2))
    assert_same_training(cp2, one, steps=6, evals=False)
