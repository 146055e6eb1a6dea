"""`scaletrain ckpt export --format hf`: what transformers loads equals the trained model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from scaletrain.checkpoint.hf_export import export_hf, export_target, hf_name
from scaletrain.checkpoint.neutral import ParamLayout
from scaletrain.engines.torch_engine import save_dcp
from scaletrain.models.llama import build_model
from scaletrain.models.presets import ModelShape
from scaletrain.models.spec import LlamaSpec

from helpers.launch import check, one_line_error, scaletrain
from helpers.numerics import assert_hf_export_matches
from helpers.runs import trainer_state


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_export_loads_in_transformers_with_the_same_logits_and_tokenizer(reference_run, small_dataset, tmp_path):
    ckpt, out = reference_run / "checkpoints" / "step_10", tmp_path / "hf"
    proc = check(scaletrain(["ckpt", "export", str(reference_run), str(out), "--format", "hf", "--dtype", "fp32"]))
    assert "step 10" in proc.stdout and "fp32" in proc.stdout
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    }
    assert_hf_export_matches(ckpt, out)
    # The run's own tokenizer went along: same ids as the one the data was prepared with.
    from transformers import AutoTokenizer

    ours = Tokenizer.from_file(str(small_dataset / "tokenizer.json"))
    text = "def f(x):\n    return {'a': [1, 2]}\n"
    assert AutoTokenizer.from_pretrained(str(out)).encode(text) == ours.encode(text).ids
    # Nothing is overwritten: a second export to the same place is a one-line error.
    one_line_error(scaletrain(["ckpt", "export", str(reference_run), str(out)]), "already exists")


def tiny_checkpoint(tmp_path, trained, optimizer=torch.optim.AdamW):
    """A DCP checkpoint of a tiny untied Llama whose optimizer held only `trained` (frozen base)."""
    shape = ModelShape(
        vocab_size=64,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
    )
    model = build_model(shape, 16, seed=0)
    params = [p for n, p in model.named_parameters() if n in trained]
    opt = optimizer(params)
    model(torch.randint(0, 64, (2, 16))).sum().backward()
    opt.step()
    ckpt = tmp_path / "step_1"
    save_dcp(model, opt, ckpt / "state")
    (ckpt / "trainer.json").write_text(trainer_state(model=shape.__dict__).to_json())
    return ckpt, shape, model


@pytest.mark.unit
# What is trained is read from the optimizer's state whatever its names: AdamW's exp_avg and
# exp_avg_sq, or momentum_buffer alone (SGD with momentum here: Muon's state for a matrix).
@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)])
def test_bf16_and_trainable_only_export_in_small_shards(tmp_path, optimizer):
    trained = {"layers.1.attention.wq.weight", "output.weight"}
    ckpt, shape, model = tiny_checkpoint(tmp_path, trained, optimizer)
    layout = ParamLayout(build_model(shape, 16, seed=0).to("meta"))
    out = tmp_path / "hf"
    # 3 KiB shards: each of these tensors (2-8 KiB in bf16) gets a file of its own or shares one.
    done = export_hf(
        ckpt, out, layout, export_target(LlamaSpec(shape), 16), dtype="bf16", trainable_only=True, max_shard_bytes=3 << 10
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert (
        set(index["weight_map"]) == {hf_name(n) for n in trained} == {"model.layers.1.self_attn.q_proj.weight", "lm_head.weight"}
    )
    assert done["files"] == len(set(index["weight_map"].values())) == 2
    weights = dict(model.named_parameters())
    for hf, file in index["weight_map"].items():
        with safe_open(str(out / file), framework="pt") as f:
            got = f.get_tensor(hf)
        name = next(n for n in trained if hf_name(n) == hf)
        assert got.dtype == torch.bfloat16 and torch.equal(got, weights[name].detach().to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
