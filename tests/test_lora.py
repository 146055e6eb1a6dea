"""LoRA through peft (model.lora): a run's merged export and its peft adapter give the
adapted model's logits, for a Hugging Face model and for the built-in one. Training on
every engine (base bit for bit, adapters moved, losses as in one process) is in
tests/test_hf_models.py."""

from __future__ import annotations

import json

import pytest
import torch

from scaletrain.checkpoint.formats import read_model_weights
from scaletrain.cli import main as cli
from scaletrain.config import load_config
from scaletrain.errors import UserError
from scaletrain.models import model_spec, saved_spec

from helpers.launch import check, train
from helpers.runs import base_overrides, dataset_windows, eval_overrides, eval_rows, loss_of

# fp32 on both sides and the same weights: the merged weight W + (alpha/r) B A rounds once
# per element (~1e-7 relative), and the implementations differ in summation order only
# (SDPA or not, the adapter's separate matmul): a few ulps of logits of size ~10, as the
# built-in export's own check (tests/helpers/numerics.py) allows.
ATOL = 1e-5
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip


def adapted_model(ckpt) -> torch.nn.Module:
    """The model the run trained, with its LoRA layers, holding the checkpoint's weights."""
    saved = json.loads((ckpt / "trainer.json").read_text())
    spec = saved_spec(saved["model"])
    model = spec.build_meta(32)
    spec.materialize(model, torch.device("cpu"), seed=0)  # buffers (rotary tables) and ties as in training
    missing, unexpected = model.load_state_dict(read_model_weights(ckpt), strict=False)
    assert not unexpected and set(missing) <= {"output.weight", "lm_head.weight"}  # a tied head is the embedding
    return model.eval()


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["hf", "builtin"])
def test_merged_export_and_peft_adapter_give_the_adapted_model_logits(small_dataset, tmp_path, source):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from scaletrain.checkpoint.hf_export import hf_name
    from scaletrain.models.params import base_name, is_adapter

    run_dir = tmp_path / "run"
    model = ["model.source=hf", f"model.hf_config={json.dumps(LLAMA)}"] if source == "hf" else []  # else the tiny preset
    args = [*base_overrides(small_dataset, run_dir, steps=4), *model]
    lora = ["data.seq_len=32", "train.lr=1e-2", "checkpoint.every=4", "model.lora={r: 4, alpha: 8}"]
    check(train([*args, *lora, *eval_overrides(small_dataset)]))
    ckpt = run_dir / "checkpoints" / "step_4"
    # The evaluation after step 4 is the adapted model's loss on its windows (2 global
    # batches of 16), as computed here from the checkpoint.
    [row] = eval_rows(run_dir)
    assert row["loss"] == pytest.approx(loss_of(adapted_model(ckpt), dataset_windows(small_dataset, 2 * 16, 32)), rel=1e-5)
    # In this process (the CLI's own entry point; a subprocess would only add its start-up).
    assert cli(["ckpt", "export", str(run_dir), str(tmp_path / "merged"), "--dtype", "fp32"]) == 0
    assert cli(["ckpt", "export", str(run_dir), str(tmp_path / "adapter"), "--lora", "adapter", "--dtype", "fp32"]) == 0

    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    want = logits(adapted_model(ckpt), ids)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged, ids), want, rtol=0, atol=ATOL)
    # The trained adapters matter: without them the logits are elsewhere.
    weights = read_model_weights(ckpt)
    rename = (lambda n: n) if source == "hf" else hf_name
    base_state = {rename(base_name(n)): w for n, w in weights.items() if not is_adapter(n)}
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tmp_path / "merged")))
    base.load_state_dict(base_state, strict=False)
    assert (logits(base, ids) - want).abs().max() > 100 * ATOL
    # peft loads the adapter onto the base model and gives the adapted logits.
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    torch.testing.assert_close(logits(adapted, ids), want, rtol=0, atol=ATOL)


@pytest.mark.unit
def test_lora_refusals_say_what_is_accepted():
    builtin = model_spec(load_config([], ["model.vocab_size=64", "model.lora={}"]), None)
    assert builtin.lora is not None and builtin.lora.targets == ("wq", "wk", "wv", "wo")  # the default
    with pytest.raises(UserError, match="parallel.tp=2 does not combine with model.lora"):
        builtin.check_tp(2)
    with pytest.raises(UserError, match=r"model.lora.target_modules \['nope'\]: peft refused them"):
        model_spec(load_config([], ["model.vocab_size=64", "model.lora={target_modules: [nope]}"]), None).build_meta(16)
    with pytest.raises(UserError, match="peft knows no default for model_type 'qwen3_moe'"):
        model_spec(
            load_config([], ["model.source=hf", "model.hf_config={model_type: qwen3_moe, vocab_size: 64}", "model.lora={}"]), None
        )


@pytest.mark.unit
def test_an_adapter_export_of_a_run_without_lora_says_what_is_accepted(tmp_path):
    from scaletrain.checkpoint.hf_export import export_target
    from scaletrain.checkpoint.lora_export import export_adapter

    plain = model_spec(load_config([], ["model.vocab_size=64"]), None)
    with pytest.raises(UserError, match=r"was not trained with model.lora; accepted: --lora merged \(the default\)"):
        export_adapter(tmp_path / "ckpt", tmp_path / "out", None, export_target(plain, 16))  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
@pytest.mark.parametrize("source", ["hf", "builtin"])
def test_lora_counts_each_weight_once_and_its_frozen_base_without_weight_gradients(source):
    # A lent H200 reported MFU 112% for LoRA on the 1b shape: PEFT's layer answers `.weight` with
    # its base layer's, which counted every adapted weight twice, and the frozen base was counted
    # at 6 FLOPs per parameter and token where it costs 4 (no weight gradient).
    shape = (
        ["model.source=hf", f"model.hf_config={json.dumps(LLAMA | {'vocab_size': 64})}"]
        if source == "hf"
        else ["model.vocab_size=64"]
    )
    plain = model_spec(load_config([], shape), 64).counts()
    spec = model_spec(load_config([], [*shape, "model.lora={r: 4, target_modules: []}"]), 64)
    lora = spec.counts()
    adapters = lora.total - plain.total
    assert adapters > 0 and lora.trainable == adapters  # only the adapters train
    assert lora.matmul == plain.matmul + adapters  # each base weight once, the adapters beside
    assert lora.frozen_matmul == plain.matmul and plain.frozen_matmul == 0
    # What telemetry's MFU counts per token: 4 per frozen weight, 6 per adapter weight, attention as before.
    attention = model_spec(load_config([], shape), 64).flops_per_token(32) - 6 * plain.matmul
    counted = spec.flops_per_token(32) - 2 * lora.frozen_matmul
    assert counted == pytest.approx(4 * plain.matmul + 6 * adapters + attention)
