"""Fine-tuning records (data.format prompt_response / chat, data/finetune.py): the prompt is
context and the response trained, in the prepared tokens, through packing, the held-out
split and a mixture; the loss is the mean over the step's trained targets at any world
size; `tokens` counts trained tokens; LoRA, a frozen base and a Hugging Face model from a
local directory train on them; with data.document_mask too."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from scaletrain.cli import main
from scaletrain.config import ModelConfig, load_config
from scaletrain.data import PackedTokens, RankBatches, prepare_dataset
from scaletrain.data.loader import split_sample, trained_targets
from scaletrain.data.prepare import CONTEXT_BIT, _load_tokenizer
from scaletrain.errors import UserError
from scaletrain.models.llama import build_model
from scaletrain.models.loss import IGNORE_INDEX
from scaletrain.models.presets import resolve_shape
from scaletrain.models.spec import LlamaSpec
from scaletrain.training.trainer import per_trained_token

from helpers.launch import check, train
from helpers.numerics import assert_same_training
from helpers.runs import STDLIB, base_overrides, eval_rows, metric_rows

SEQ = 64
# A template in the ChatML form many models ship (Qwen's, simplified): each message in
# <|im_start|>role ... <|im_end|>, and the generation prompt is the assistant's header.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _lines(n: int) -> list[str]:
    text = (STDLIB / "json" / "decoder.py").read_text() + (STDLIB / "json" / "encoder.py").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()][:n]


def _pairs(path, n: int = 240):
    """Prompt: one source line; response: the next one to three (varied lengths, so micro-
    batches hold different numbers of trained targets)."""
    lines = _lines(n + 3)
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"prompt": lines[i], "response": " ".join(lines[i + 1 : i + 2 + i % 3])}) + "\n")
    return path


@pytest.fixture(scope="module")
def sft(small_dataset, tmp_path_factory):
    """prompt/response records prepared with the small corpus's tokenizer (vocab 512)."""
    out = tmp_path_factory.mktemp("sft")
    prepare_dataset(
        [str(_pairs(out / "pairs.jsonl"))], out / "data", tokenizer=str(small_dataset), show_progress=False, shard_tokens=4096
    )
    return out / "data"


def _pieces(data_dir, tokenizer) -> list[tuple[str, str]]:
    """Each document's (context text, trained text) decoded from the prepared shards."""
    data = PackedTokens(data_dir, SEQ, 0)
    stream = np.concatenate(data.documents(held=False)).astype(np.int64)
    out, start = [], 0
    for end in np.flatnonzero(stream == data.eos_id) + 1:
        doc = stream[start:end]
        context = doc & CONTEXT_BIT != 0
        ids = [list(doc[context] & (CONTEXT_BIT - 1)), list(doc[~context])]
        out.append(tuple(tokenizer.decode(i, skip_special_tokens=False) for i in ids))
        start = end
    return out


@pytest.mark.unit
def test_prompts_are_context_and_responses_trained(sft, small_dataset):
    manifest = json.loads((sft / "manifest.json").read_text())
    assert manifest["loss_mask"] is True and manifest["dtype"] == "uint32" and manifest["formats"] == ["prompt_response"]
    tok = _load_tokenizer(small_dataset)
    lines = _lines(243)
    pieces = _pieces(sft, tok)
    assert len(pieces) == 240 == manifest["documents"]
    for i, (context, trained) in enumerate(pieces[:50]):
        # The eos that ends each record is trained (where a response ends is learnt).
        assert context == lines[i] and trained == " ".join(lines[i + 1 : i + 2 + i % 3]) + "<|endoftext|>", i
    documents = PackedTokens(sft, SEQ, 0).documents(held=False)
    assert manifest["trained_tokens"] == sum(int(np.count_nonzero(d & CONTEXT_BIT == 0)) for d in documents)


@pytest.mark.unit
def test_a_chat_is_rendered_by_the_tokenizers_template_and_trains_the_assistant(small_dataset, tmp_path):
    chat = tmp_path / "chat.jsonl"
    talk = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is json?"},
        {"role": "assistant", "content": "A data format."},
        {"role": "user", "content": "And pickle?"},
        {"role": "assistant", "content": "A Python one."},
    ]
    chat.write_text(json.dumps({"messages": talk}) + "\n")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copyfile(small_dataset / "tokenizer.json", tok_dir / "tokenizer.json")
    tok = _load_tokenizer(small_dataset)
    # Without a template: "role: content" lines, the assistant's content and newline trained.
    prepare_dataset([str(chat)], tmp_path / "plain", tokenizer=str(tok_dir), show_progress=False)
    ((context, trained),) = _pieces(tmp_path / "plain", tok)
    assert trained == "A data format.\nA Python one.\n<|endoftext|>"
    assert context == "system: Be brief.\nuser: What is json?\nassistant: user: And pickle?\nassistant: "
    # With the tokenizer's own template (tokenizer_config.json, as transformers saves it).
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>"}))
    prepare_dataset([str(chat)], tmp_path / "templated", tokenizer=str(tok_dir), show_progress=False)
    ((context, trained),) = _pieces(tmp_path / "templated", tok)
    assert trained == "A data format.<|im_end|>\nA Python one.<|im_end|>\n<|endoftext|>"
    assert context.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert context.endswith("<|im_start|>user\nAnd pickle?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.unit
def test_the_loss_is_the_mean_over_response_tokens_only(sft):
    data = PackedTokens(sft, SEQ, 0)
    batches = RankBatches(data, micro_batch=2, grad_accum=2, dp_rank=0, dp_size=1)
    model = build_model(resolve_shape(ModelConfig(preset="tiny"), data.vocab_size), SEQ, seed=0)
    loss = per_trained_token(LlamaSpec(model.shape).loss, batches, ranks=1)
    window = batches.next_step()
    raw = data.batch(range(4))  # the same 4 samples, read independently
    with torch.no_grad():
        got = sum(float(loss(model(x), y)) for x, y in window) / 2  # engines average the window
    # Expected, from the raw tokens: the cross entropy at the positions whose target is not
    # context, averaged over all of them in the step.
    tokens = torch.from_numpy(raw & (CONTEXT_BIT - 1))
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    every = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
    trained = torch.from_numpy((raw[:, 1:] & CONTEXT_BIT) == 0).reshape(-1)
    assert 0 < int(trained.sum()) < trained.numel() == 4 * SEQ  # some of each
    assert batches.step_tokens == int(trained.sum()) == trained_targets(raw)
    np.testing.assert_allclose(got, float(every[trained].mean()), rtol=1e-6)  # fp32 sums of 256 terms, regrouped
    # Each window's targets: the ignored index exactly where the raw target is context.
    x, y = split_sample(torch.from_numpy(raw), masked=True)
    assert torch.equal((y == IGNORE_INDEX).reshape(-1), ~trained) and int(x.max()) < data.vocab_size


@pytest.mark.unit
def test_a_step_of_context_only_has_zero_loss_and_no_nan():
    model = build_model(resolve_shape(ModelConfig(preset="tiny"), 64), 8, seed=0)
    targets = torch.full((2, 8), IGNORE_INDEX)
    value = LlamaSpec(model.shape).loss(model(torch.zeros(2, 8, dtype=torch.long)), targets)
    value.backward()
    assert float(value.detach()) == 0.0 and all(torch.isfinite(p.grad).all() for p in model.parameters())


STEPS, GLOBAL_BATCH = 6, 4


def _run(sft, run, *extra: str) -> list[str]:
    # Evaluated on the records themselves (their trained targets only) at steps 3 and 6.
    evals = ["eval.every=3", f"eval.data={sft}", "eval.batches=2"]
    return [*base_overrides(sft, run, steps=STEPS), "checkpoint.every=6", "data.document_mask=true", *evals, *extra]


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_fine_tuning_is_one_process_at_world_2_on_fsdp_tp_and_ulysses(sft, tmp_path):
    # Micro-batches hold different numbers of trained targets: only the mean over the
    # step's trained targets (trainer.per_trained_token) agrees across layouts; a mean per
    # micro-batch averaged over ranks and accumulation does not. Documents masked too.
    one = tmp_path / "one"
    check(train(_run(sft, one, f"train.micro_batch={GLOBAL_BATCH}", "parallel.strategy=fsdp")))
    rows = metric_rows(one)
    data = PackedTokens(sft, SEQ, seed=1234)  # train.seed's default: the run's sample order
    trained = [trained_targets(data.batch(range(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH))) for s in range(STEPS)]
    assert [r["tokens"] for r in rows] == list(np.cumsum(trained))  # trained tokens, not all 4 x 64 per step
    assert len(set(trained)) > 1 and max(trained) < GLOBAL_BATCH * SEQ
    assert 0 < eval_rows(one)[0]["tokens"] < 2 * GLOBAL_BATCH * SEQ  # the eval loss too: over trained targets
    layouts = {
        "fsdp": ["train.micro_batch=1", "train.grad_accum=2", "parallel.strategy=fsdp"],
        "tp": [f"train.micro_batch={GLOBAL_BATCH}", "parallel.strategy=fsdp", "parallel.tp=2"],
        # Each rank holds half of every sequence, so its own count of trained targets: the
        # loss is still the mean over the step's (dp x cp ranks' counts summed).
        "ulysses-zero3": [f"train.micro_batch={GLOBAL_BATCH}", "parallel.strategy=zero3", "parallel.cp=2",
                          "parallel.cp_mode=ulysses"],
    }  # fmt: skip
    for name, extra in layouts.items():
        check(train(_run(sft, tmp_path / name, *extra), nproc=2))
        assert_same_training(tmp_path / name, one, steps=STEPS)


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_a_hugging_face_llama_with_lora_fine_tunes_under_ulysses_on_zero3_as_one_process(sft, tmp_path):
    # transformers' attention interface runs the all-to-alls (models/ulysses.py hf_attention);
    # a pre-hook gives the model this rank's positions at their global position ids. 4 query
    # heads and 2 key/value heads over cp 2; LoRA's adapters in the attention's projections;
    # the loss over the responses' targets only, each rank holding its half of every record.
    hf = "model.hf_config={model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
    hf += "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64}"
    common = [*(o for o in base_overrides(sft, tmp_path, steps=STEPS) if not o.startswith(("model.preset", "run.dir"))),
              "model.source=hf", hf, "model.lora={r: 4, alpha: 8}", "train.lr=1e-2", f"train.micro_batch={GLOBAL_BATCH}",
              "eval.every=3", f"eval.data={sft}", "eval.batches=2"]  # fmt: skip
    one, cp2 = tmp_path / "one", tmp_path / "cp2"
    check(train([*common, f"run.dir={one}", "parallel.strategy=zero3"]))
    check(train([*common, f"run.dir={cp2}", "parallel.strategy=zero3", "parallel.cp=2", "parallel.cp_mode=ulysses"], nproc=2))
    assert_same_training(cp2, one, steps=STEPS)


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_lora_a_frozen_base_and_a_local_hugging_face_model_fine_tune(sft, small_dataset, tmp_path):
    from scaletrain.data.prepare import _vocab_size
    from test_hf_models import save_llama

    model_dir = tmp_path / "hf"
    save_llama(model_dir, _vocab_size(_load_tokenizer(small_dataset)), dtype=torch.float32)
    cases = {
        "lora": ["model.lora={r: 4, alpha: 8}", "train.lr=1e-2"],
        "hf-frozen": ["model.source=hf", f"model.path={model_dir}", "model.trainable=[model.layers.1.*]", "train.lr=1e-2"],
    }
    for name, extra in cases.items():
        run = tmp_path / name
        args = [o for o in base_overrides(sft, run, steps=STEPS) if not o.startswith("model.preset")] + extra
        check(train([*args, "model.preset=tiny" if name == "lora" else "train.micro_batch=2", "data.seq_len=32"]))
        rows, cfg = metric_rows(run), load_config([str(run / "config.yaml")])
        processed = STEPS * cfg.train.micro_batch * cfg.train.grad_accum * 32
        assert rows[-1]["loss"] < rows[0]["loss"] and 0 < rows[-1]["tokens"] < processed, name


@pytest.mark.e2e
def test_what_does_not_combine_is_one_line_exit_2(sft, tmp_path, capsys):
    base = ["train", f"run.dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'cache'}", "run.device=cpu", "train.steps=1"]
    text = STDLIB / "json" / "tool.py"
    cases = {
        (f"data.paths={text}", "data.format=chat"): f"data.format=chat reads .jsonl records; '{text}' is not one",
        (f"data.paths={sft}", "model.teacher={preset: tiny}"): "model.teacher does not combine with fine-tuning records",
        (f"data.paths={sft}", "data.document_mask=true", "model.source=hf", "model.hf_config={model_type: llama}"): (
            "data.document_mask=true needs the built-in model"
        ),
    }
    for args, says in cases.items():
        assert main([*base, *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("scaletrain: error:") and says in err[0], err
    # A pipeline needs a world of 2 or more; its refusal is the spec's (before any process starts).
    masked = LlamaSpec(resolve_shape(ModelConfig(preset="tiny", tie_embeddings=False), 64), document_eos=0)
    with pytest.raises(UserError, match="parallel.pp=2 does not combine with data.document_mask"):
        masked.check_pp(2)
