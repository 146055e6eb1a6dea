"""A model of your own (model.source: python, models/module_spec.py): a GPT-2-style decoder
(examples/gpt2/gpt2.py: learned positions, LayerNorm with biases, a fused qkv, GELU, a tied
head; nothing of the built-in Llama) trains on ddp, fsdp, zero2 and zero3 at world 2 as one
process does, resumes at another world size, evaluates, converts, exports and is planned; the
tensor-parallel plan it offers (ModuleSpec(..., offers=[...])) trains as one process does; what
it does not offer (pipeline, context parallel; tensor parallel without the plan) is refused in
one line."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from scaletrain.checkpoint import read_model_weights
from scaletrain.config import load_config
from scaletrain.errors import UserError
from scaletrain.models import model_spec
from scaletrain.models.capabilities import ContextChunks, PipelineStages, TensorParallel, Traceable, capability
from scaletrain.models.module_spec import ModuleSpec, from_import

from helpers.launch import check, one_line_error, scaletrain, train
from helpers.numerics import assert_same_training
from helpers.runs import base_overrides, copy_until, eval_overrides, eval_rows, final_weights, metric_rows, run_info

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt2"
# Every rank imports the spec's module: the launcher's ranks inherit this.
ENV = {"PYTHONPATH": os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")])}
GPT2 = ["model.source=python", "model.spec=gpt2:make_spec", "model.spec_args={dim: 32, layers: 2, heads: 4, max_len: 64}"]
# The key third of each fused qkv bias ([q | k | v], 32 each): zero gradient by construction
# (helpers.numerics.GRADIENT_FREE_STEP), compared with what Adam's step bound allows.
KEY_BIASES = {f"h.{i}.qkv.bias": slice(32, 64) for i in range(2)}


@pytest.fixture(autouse=True)
def example_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))


def gpt2_args(data: Path, run: Path, *more: str) -> list[str]:
    overrides = [o for o in base_overrides(data, run) if not o.startswith("model.")]
    return [*overrides, *GPT2, *eval_overrides(data), "checkpoint.every=5", *more]


# ---------------------------------------------------------------------------- the spec


@pytest.mark.unit
def test_the_config_names_the_spec_and_nothing_else_of_a_model():
    cfg = load_config([], GPT2)
    assert (cfg.model.source, cfg.model.spec, cfg.model.spec_args["dim"]) == ("python", "gpt2:make_spec", 32)
    for bad, says in [
        (["model.source=python"], "model.source=python needs model.spec as 'package.module:function' (got None)"),
        (["model.source=python", "model.spec=gpt2.make_spec"], "needs model.spec as 'package.module:function'"),
        (["model.spec=gpt2:make_spec"], "model.spec is for a model of your own; accepted: model.source=python"),
        ([*GPT2, "model.dim=64"], "model.dim does not apply to a model of your own; accepted: its arguments in model.spec_args"),
        ([*GPT2, "model.lora={}"], "model.lora adapts the built-in or a Hugging Face model's known layers"),
    ]:
        with pytest.raises(UserError, match=re.escape(says)):
            load_config([], bad)


@pytest.mark.unit
def test_an_import_string_that_fails_says_how_in_one_line():
    for spec, says in [
        ("no_such_module:make", "cannot import no_such_module"),
        ("gpt2:no_such_function", "gpt2 has no function 'no_such_function'"),
        ("gpt2:_matmul_params", "returned int; accepted: scaletrain.ModuleSpec"),  # a function, not a spec maker
    ]:
        with pytest.raises(UserError, match=says) as e:
            from_import(spec, {"dim": 8, "layers": 1} if spec.endswith("params") else {}, 512)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=r"called with \['vocab_size', 'width'\]"):
        from_import("gpt2:make_spec", {"width": 3}, 512)
    with pytest.raises(UserError, match="accepted: model.spec_args.vocab_size=N"):
        from_import("gpt2:make_spec", {}, None)


@pytest.mark.unit
def test_counts_flops_blocks_and_width_come_from_the_module():
    spec = model_spec(load_config([], GPT2), 512)
    model = spec.build_meta(64)
    assert spec.hidden_size == 32 and spec.n_blocks == 2 and spec.blocks(model) is model.h
    c = spec.counts()
    assert c.total == sum(p.numel() for p in model.parameters())  # the tied head once
    assert c.embedding == 512 * 32 + 64 * 32 and c.block == sum(p.numel() for p in model.h[0].parameters())
    # The example's own FLOPs: 6 x matmul parameters (its tied head included) + attention.
    assert spec.flops_per_token(64) == 6 * c.matmul + 12 * 2 * 32 * 64
    # Without flops_per_token, 6 x the matmul parameters; without blocks=, the longest ModuleList.
    bare = ModuleSpec(lambda: model_class()(512, 32, 2, 4, 64), vocab_size=512)
    assert bare.flops_per_token(64) == 6 * c.matmul and bare.n_blocks == 2
    assert spec.config() == {
        "source": "python", "spec": "gpt2:make_spec", "spec_args": {"dim": 32, "heads": 4, "layers": 2, "max_len": 64},
        "vocab_size": 512,
    }  # fmt: skip


def model_class():
    import gpt2

    return gpt2.GPT


@pytest.mark.unit
def test_materialize_is_seeded_by_name_keeps_the_head_tied_and_refuses_unfilled_buffers():
    spec = model_spec(load_config([], GPT2), 512)
    a, b = spec.build_meta(64), spec.build_meta(64)
    spec.materialize(a, torch.device("cpu"), seed=7)
    spec.materialize(b, torch.device("cpu"), seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.lm_head.weight is a.wte.weight  # to_empty had untied it: re-tied
    assert torch.equal(a.h[0].ln_1.weight, torch.ones(32)) and torch.equal(a.h[0].qkv.bias, torch.zeros(96))
    assert 0.015 < a.h[0].qkv.weight.std().item() < 0.025  # normal(0, 0.02)

    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.layers = nn.Embedding(16, 8), nn.ModuleList([nn.Linear(8, 8)])
            self.register_buffer("scale", torch.ones(8))

    with_buffer = ModuleSpec(WithBuffer, vocab_size=16)
    with pytest.raises(UserError, match=r"buffers \['scale'\] have no values .* accepted: ModuleSpec\(..., init=fn\)"):
        with_buffer.materialize(with_buffer.build_meta(8), torch.device("cpu"), 0)


@pytest.mark.unit
def test_what_a_module_does_not_offer_is_refused_in_one_place():
    spec = model_spec(load_config([], GPT2), 512)
    assert isinstance(spec, Traceable)  # the planner's trace: the first block's call, the head found
    for cap, key in [(TensorParallel, "parallel.tp=2"), (PipelineStages, "parallel.pp=2"), (ContextChunks, "parallel.cp=2")]:
        with pytest.raises(UserError) as e:
            capability(spec, cap, key, key[:-1] + "1")
        line = str(e.value)
        assert line.startswith(f"{key} needs ") and "the model gpt2:make_spec does not offer" in line, line
        assert line.endswith(f"accepted: {key[:-1]}1") and "\n" not in line
    head = spec.traced_head()
    assert [type(m).__name__ for m in head] == ["LayerNorm", "Linear"]


# ---------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def gpt2_reference(small_dataset, tmp_path_factory):
    """One process, ddp, global batch 4, 10 fp32 steps, evaluated at 4, 8, 10: as conftest's reference_run."""
    run = tmp_path_factory.mktemp("gpt2") / "ddp1"
    check(train(gpt2_args(small_dataset, run, "train.micro_batch=4"), env=ENV))
    return run


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_engine_at_world_2_trains_it_as_one_process_does(small_dataset, gpt2_reference, tmp_path):
    info = run_info(gpt2_reference)
    assert (info["engine"], info["world_size"]) == ("ddp", 1)
    for strategy in ("ddp", "fsdp", "zero2", "zero3"):
        run = tmp_path / strategy
        extra = ["parallel.bucket_size=2000000"] if strategy.startswith("zero") else []  # as the ZeRO tests: fast on 2 cores
        check(
            train(gpt2_args(small_dataset, run, "train.micro_batch=2", f"parallel.strategy={strategy}", *extra), nproc=2, env=ENV)
        )
        assert (run_info(run)["engine"], run_info(run)["world_size"]) == (strategy, 2)
        # Losses, grad norms, evals and final weights, the standing tolerances.
        assert_same_training(run, gpt2_reference, gradient_free=KEY_BIASES)
        if strategy == "fsdp":
            fsdp = run
    weights = final_weights(fsdp, 10)
    assert torch.equal(weights["lm_head.weight"], weights["wte.weight"])  # still tied after sharding

    # fsdp at world 2 stopped after step 5, continued by one process: as if it had never stopped.
    resumed = tmp_path / "resumed"
    copy_until(fsdp, resumed, 5)
    check(train(gpt2_args(small_dataset, resumed, "train.micro_batch=4", "parallel.strategy=fsdp"), env=ENV))
    assert [r["step"] for r in metric_rows(resumed)] == list(range(1, 11))
    assert_same_training(resumed, gpt2_reference, gradient_free=KEY_BIASES)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_its_checkpoint_evaluates_exports_and_its_run_is_planned(small_dataset, gpt2_reference, tmp_path):
    # eval rebuilds the model from trainer.json (the import string and its arguments), as resume does.
    proc = check(scaletrain(["eval", str(gpt2_reference / "checkpoints" / "step_10"), *eval_overrides(small_dataset)], env=ENV))
    (last,) = [r for r in eval_rows(gpt2_reference) if r["step"] == 10]
    got = float(re.search(r"\(step 10\): loss (\S+)", proc.stdout)[1])
    assert got == pytest.approx(last["loss"], rel=1e-5)  # the same windows and weights: the run's own eval at step 10

    out = tmp_path / "export"
    check(scaletrain(["ckpt", "export", str(gpt2_reference / "checkpoints" / "step_10"), str(out), "--dtype", "fp32"], env=ENV))
    exported = load_file(out / "model.safetensors")
    import gpt2

    model = gpt2.GPT(512, 32, 2, 4, 64)
    model.load_state_dict(exported, strict=True)  # its own names, the tied head under both
    want = final_weights(gpt2_reference, 10)
    assert all(torch.equal(exported[k], want[k]) for k in want)

    plan = check(
        scaletrain(["plan", *gpt2_args(small_dataset, tmp_path / "p"), "--gpus-per-node", "8", "--gpu", "h100"], env=ENV)
    )
    assert plan.stdout.startswith("plan for model gpt2 (gpt2:make_spec): ")
    assert "ddp" in plan.stdout and "zero3" in plan.stdout and " tp " not in plan.stdout  # no tensor-parallel candidate


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_ckpt_convert_rebuilds_it_from_the_import_string(gpt2_reference, tmp_path):
    # convert builds the target engine's model from trainer.json alone: the import string and its arguments.
    src, dst = gpt2_reference / "checkpoints" / "step_10", tmp_path / "fsdp" / "checkpoints" / "step_10"
    proc = check(scaletrain(["ckpt", "convert", str(src), str(dst), "--to", "fsdp"], env=ENV))
    assert "verified" in proc.stdout and f"train.resume={dst}" in proc.stdout
    saved, converted = (json.loads((d / "trainer.json").read_text()) for d in (src, dst))
    assert converted["model"] == saved["model"] and saved["model"]["spec"] == "gpt2:make_spec"
    assert (converted["engine"], converted["step"], converted["data_position"]) == ("fsdp", 10, saved["data_position"])
    a, b = read_model_weights(src), read_model_weights(dst)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the tied head included


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_a_tensor_parallel_plan_it_offers_trains_as_one_process_does(small_dataset, gpt2_reference, tmp_path):
    """examples/gpt2's MlpTensorParallel, offered through ModuleSpec(..., offers=[...]): fsdp
    with tp 2 at world 2 (one data-parallel rank accumulating the reference's 4 sequences as 2
    x 2) equals one process within the standing tolerances: each rank holds half of every
    feed-forward, its fc by columns and its out by rows, and the all-reduce after out gives
    both ranks the whole residual. The planner offers tp for it where it had none."""
    offered = [*GPT2[:2], "model.spec_args={dim: 32, layers: 2, heads: 4, max_len: 64, tensor_parallel: true}"]
    spec = model_spec(load_config([], offered), 512)
    assert capability(spec, TensorParallel, "parallel.tp=2", "parallel.tp=1") is spec.offers[0]
    run = tmp_path / "tp2"
    args = ["train.micro_batch=2", "train.grad_accum=2", "parallel.strategy=fsdp", "parallel.tp=2", *offered]
    check(train(gpt2_args(small_dataset, run, *args), nproc=2, env=ENV))
    assert_same_training(run, gpt2_reference, gradient_free=KEY_BIASES)
    # Split as offered: the checkpoint holds each rank's half (fc by rows of its [128, 32]
    # weight, out by columns of its [32, 128]); the attention whole, once.
    meta = FileSystemReader(str(run / "checkpoints" / "step_10" / "state")).read_metadata().state_dict_metadata
    chunks = {k: sorted(tuple(c.offsets) for c in meta[f"model.h.0.{k}.weight"].chunks) for k in ("fc", "out", "qkv")}
    assert chunks == {"fc": [(0, 0), (64, 0)], "out": [(0, 0), (0, 64)], "qkv": [(0, 0)]}
    plan = check(
        scaletrain(
            ["plan", *gpt2_args(small_dataset, tmp_path / "p", *offered), "--gpus-per-node", "8", "--gpu", "h100"], env=ENV
        )
    )
    assert " tp " in plan.stdout  # a tensor-parallel candidate now


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2"])
def test_a_layout_it_does_not_offer_is_one_line(small_dataset, tmp_path, layout):
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    accumulate = ["train.micro_batch=2", "train.grad_accum=2"] if "pp" in layout else []  # 1f1b: 2 micro-batches a step
    proc = train([*gpt2_args(small_dataset, tmp_path / "run", "parallel.strategy=fsdp", layout, *accumulate)], nproc=2, env=ENV)
    one_line_error(proc, f"{layout} needs", "the model gpt2:make_spec does not offer", f"accepted: {layout[:-1]}1")
