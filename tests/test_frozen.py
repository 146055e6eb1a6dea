"""Frozen base, subset training (model.trainable): on every engine, frozen parameters stay
bit for bit, trainable ones change, and only trainable ones get optimizer state."""

from __future__ import annotations

import fnmatch
import json
import os
import sys

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.errors import UserError
from scaletrain.models import resolve_shape
from scaletrain.models.spec import LlamaSpec
from scaletrain.strategies import FORMATS, TABLE

from helpers.launch import PROBES, check, probe_command, run, scaletrain, train
from helpers.numerics import assert_bit_exact
from helpers.runs import base_overrides, copy_until, final_weights, trainer_state

sys.path.insert(0, str(PROBES))
from frozen import STRATEGIES, TRAINABLE  # noqa: E402


@pytest.fixture(scope="module")
def frozen_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("frozen")
    check(run(probe_command("frozen", ["--out", str(out)], nproc=2), timeout=400))
    return json.loads((out / "frozen.json").read_text())


@pytest.mark.dist
@pytest.mark.timeout(500)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_only_the_trainable_parameters_change_and_have_optimizer_state(frozen_runs, strategy):
    got = frozen_runs[strategy]
    trainable = sorted(n for n in got["names"] if fnmatch.fnmatchcase(n, TRAINABLE))
    assert trainable and len(trainable) < len(got["names"])  # a real subset
    assert got["changed"] == trainable  # frozen ones bit for bit, every trainable one moved
    assert got["with_state"] == trainable


# checkpoint.frozen=reference: the checkpoint holds the trained parameters only; a fresh
# engine, whose frozen parameters come from the base again, loads it (natively, and the
# previous strategy's through resharding or conversion) and then equals the trained engine
# in every weight and moment, bit for bit.
@pytest.mark.dist
@pytest.mark.timeout(500)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_checkpoint_without_the_frozen_base_resumes_exactly(frozen_runs, strategy):
    got = frozen_runs[strategy]
    trained = [n for n in got["names"] if fnmatch.fnmatchcase(n, TRAINABLE)]
    # DeepSpeed's ZeRO-1/2 module file drops a frozen parameter under its first name only
    # (DeepSpeedEngine.module_state_dict walks named_parameters(), which lists a tied weight
    # once): the frozen output head tied to the embedding stays. docs/checkpointing.md.
    quirk = ["output.weight"] if strategy in ("zero1", "zero2") else []
    assert got["held"] == sorted(trained + quirk)
    assert (got["reloaded"], got["difference"]) == ("native", None)
    if strategy != STRATEGIES[0]:
        previous = STRATEGIES[STRATEGIES.index(strategy) - 1]
        fmt = TABLE[strategy].format  # DCP reshards natively; the rest converts
        native = TABLE[previous].format == fmt and FORMATS[fmt].reshards
        assert got["previous"] == ("resharded" if native else "converted")


@pytest.mark.unit
def test_a_pattern_that_matches_nothing_names_real_parameters():
    cfg = load_config([], ["model.vocab_size=64", "model.trainable=['layers.*.attn.*']"])
    spec = LlamaSpec(resolve_shape(cfg.model), trainable=tuple(cfg.model.trainable))
    with pytest.raises(
        UserError, match=r"model.trainable pattern 'layers.\*.attn.\*' matches no parameter; accepted: .*'tok_embeddings.weight'"
    ):
        spec.build_meta(16)


@pytest.mark.unit
def test_a_tied_weight_trains_when_either_name_matches():
    cfg = load_config([], ["model.vocab_size=64", "model.trainable=['output.*']"])  # the tiny preset ties
    model = LlamaSpec(resolve_shape(cfg.model), trainable=("output.*",)).build_meta(16)
    assert model.tok_embeddings.weight.requires_grad and model.output.weight is model.tok_embeddings.weight
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("layers."))


@pytest.mark.unit
def test_resume_refuses_another_trainable_set(tmp_path):
    from scaletrain.checkpoint.resume import check_config

    (tmp_path / "config.yaml").write_text(load_config([], ["model.trainable=['layers.*']"]).to_yaml())
    with pytest.raises(
        UserError, match=r"model.trainable is \[\] but checkpoint .* was trained with \['layers.\*'\] \(its optimizer"
    ):
        check_config(tmp_path, load_config([], []), trainer_state(), {}, "x")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_frozen_base_run_without_its_base_in_checkpoints_resumes_and_exports(small_dataset, tmp_path):
    # checkpoint.frozen=reference through the CLI, one process: the checkpoints hold the
    # trained tensors only, a resume from one equals the straight run bit for bit, and an
    # export holds the trained tensors (--trainable-only) or the whole model, the frozen
    # part rebuilt from the base (the seeded init of train.seed).
    from safetensors.torch import load_file

    from scaletrain.checkpoint.hf_export import hf_name
    from scaletrain.models import model_spec

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ["checkpoint.every=3", "checkpoint.frozen=reference", "model.trainable=['layers.*.feed_forward.*','norm.weight']"]
    check(train([*base_overrides(small_dataset, straight, steps=6), *args]))
    trained = {f"layers.{i}.feed_forward.w{j}.weight" for i in range(4) for j in (1, 2, 3)} | {"norm.weight"}
    assert set(final_weights(straight, 6)) == trained  # nothing frozen on disk
    copy_until(straight, resumed, step=3)
    check(train([*base_overrides(small_dataset, resumed, steps=6), *args]))
    assert_bit_exact(resumed, straight, 6)

    ckpt = straight / "checkpoints" / "step_6"
    check(scaletrain(["ckpt", "export", str(ckpt), str(tmp_path / "trained"), "--trainable-only", "--dtype", "fp32"]))
    check(scaletrain(["ckpt", "export", str(ckpt), str(tmp_path / "whole"), "--dtype", "fp32"]))
    only = load_file(tmp_path / "trained" / "model.safetensors")
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    assert set(only) == {hf_name(n) for n in trained}
    # The base as every engine builds it at start (frozen parameters never move: the probe above).
    cfg = load_config([str(ckpt / "config.yaml")])
    spec = model_spec(cfg, 512)
    model = spec.build_meta(cfg.data.seq_len)
    spec.materialize(model, torch.device("cpu"), cfg.train.seed)
    base = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    assert set(whole) == {hf_name(n) for n in base if n != "output.weight"}  # tied to the embedding
    for name, value in base.items():
        if name != "output.weight":
            want = only[hf_name(name)] if name in trained else value
            assert torch.equal(whole[hf_name(name)], want), name
    assert not torch.equal(only[hf_name("norm.weight")], base["norm.weight"])  # it trained


@pytest.mark.unit
def test_a_resume_refuses_a_base_that_changed(tmp_path):
    from safetensors.torch import save_file

    from scaletrain.checkpoint.frozen_base import base_reference, check_base

    base = tmp_path / "base"
    base.mkdir()
    save_file({"w": torch.zeros(4)}, base / "model.safetensors")
    cfg = load_config([], ["model.source=hf", f"model.path={base}"])
    saved = base_reference(cfg)
    check_base(tmp_path, saved, cfg)  # unchanged
    save_file({"w": torch.ones(4)}, base / "model.safetensors")  # rewritten: same size, a new time
    os.utime(base / "model.safetensors", (0, 12345))
    with pytest.raises(
        UserError, match=r"the base weights at .*base are not those checkpoint .* was trained on \(model.safetensors differs"
    ):
        check_base(tmp_path, saved, cfg)
    seeded = base_reference(load_config([], ["train.seed=1"]))
    with pytest.raises(
        UserError, match=r"refers to the seeded init of train.seed=1, but this run starts from the seeded init of train.seed=2"
    ):
        check_base(tmp_path, seeded, load_config([], ["train.seed=2"]))


@pytest.mark.unit
def test_the_planner_counts_no_gradient_or_optimizer_state_for_frozen_parameters():
    from scaletrain.planning import planning_spec
    from scaletrain.planning.memory import Setup, estimate

    def memory(*overrides: str):
        spec = planning_spec(load_config([], ["model.preset=8b", *overrides]))
        return spec, estimate(spec, Setup("fsdp", 8, 1, 4096, "bf16"))

    _, full = memory()
    spec, frozen = memory("model.trainable=['layers.*.attention.*']")
    share = spec.counts().trainable / spec.counts().total
    assert 0.05 < share < 0.3  # the attention projections of an 8B: 1.3B of 8.0B
    assert frozen.params == full.params  # frozen weights are still held
    assert frozen.grads == pytest.approx(full.grads * share) and frozen.optimizer == pytest.approx(full.optimizer * share)


@pytest.mark.unit
def test_a_pipeline_stage_with_nothing_to_train_is_refused():
    from scaletrain.config.parallel import ParallelDims
    from scaletrain.engines.fsdp import stage_parts

    shape = resolve_shape(load_config([], ["model.vocab_size=64", "model.tie_embeddings=false"]).model)
    frozen_first_stage = LlamaSpec(shape, trainable=("output.weight",))
    with pytest.raises(UserError, match=r"pipeline stage 0 \(blocks 0-1\) has no trainable parameter under model.trainable"):
        stage_parts(frozen_first_stage, ParallelDims(1, 1, pp=2), 0, "1f1b", 16)
    ids, parts, _ = stage_parts(LlamaSpec(shape, trainable=("layers.*",)), ParallelDims(1, 1, pp=2), 1, "1f1b", 16)
    assert ids == [1] and any(p.requires_grad for p in parts[0].parameters())
