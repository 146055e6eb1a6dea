"""Frozen base, subset training (model.trainable): on every engine, frozen parameters stay
bit for bit, trainable ones change, and only trainable ones get optimizer state."""

from __future__ import annotations

import fnmatch
import json
import sys

import pytest

from scaletrain.config import load_config
from scaletrain.errors import UserError
from scaletrain.models import resolve_shape
from scaletrain.models.spec import LlamaSpec

from helpers import PROBES, base_overrides, check, probe_command, run, scaletrain, train

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
        check_config(tmp_path, load_config([], []), {}, {}, "x")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_frozen_base_run_exports_exactly_its_trainable_tensors(small_dataset, tmp_path):
    from scaletrain.checkpoint.hf_export import hf_name

    run_dir, out = tmp_path / "run", tmp_path / "hf"
    patterns = "model.trainable=['layers.*.feed_forward.*','norm.weight']"
    check(train([*base_overrides(small_dataset, run_dir, steps=4), "checkpoint.every=4", patterns]))
    check(scaletrain(["ckpt", "export", str(run_dir), str(out), "--trainable-only"]))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    names = [f"layers.{i}.feed_forward.w{j}.weight" for i in range(4) for j in (1, 2, 3)] + ["norm.weight"]
    assert set(index["weight_map"]) == {hf_name(n) for n in names}


@pytest.mark.unit
def test_the_planner_counts_no_gradient_or_optimizer_state_for_frozen_parameters():
    from scaletrain.plan import planning_spec
    from scaletrain.plan.memory import Setup, estimate

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
    from scaletrain.engines.fsdp import stage_parts
    from scaletrain.parallel import ParallelDims

    shape = resolve_shape(load_config([], ["model.vocab_size=64", "model.tie_embeddings=false"]).model)
    frozen_first_stage = LlamaSpec(shape, trainable=("output.weight",))
    with pytest.raises(UserError, match=r"pipeline stage 0 \(blocks 0-1\) has no trainable parameter under model.trainable"):
        stage_parts(frozen_first_stage, ParallelDims(1, 1, pp=2), 0, "1f1b", 16)
    ids, parts, _ = stage_parts(LlamaSpec(shape, trainable=("layers.*",)), ParallelDims(1, 1, pp=2), 1, "1f1b", 16)
    assert ids == [1] and any(p.requires_grad for p in parts[0].parameters())
