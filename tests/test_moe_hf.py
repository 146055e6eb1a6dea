"""Mixtures of experts and Hugging Face: a built-in tiny-moe checkpoint (written by fsdp
with the experts split over 2 ranks) exports as a MixtralForCausalLM that transformers
loads with the same loss; what Mixtral cannot express is refused in one line; a Hugging
Face Mixtral (fsdp and zero3) or Qwen2-MoE (fsdp), saved as save_pretrained saves them
(one tensor per expert), trains at world 2 equal to one process, the router's
load-balancing term in the loss as transformers adds it, and exports back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from scaletrain.checkpoint import read_model_weights
from scaletrain.checkpoint.hf_export import export_target
from scaletrain.errors import UserError
from scaletrain.models.presets import ModelShape
from scaletrain.models.spec import LlamaSpec

from helpers.launch import check, one_line_error, scaletrain, train
from helpers.numerics import GRAD_NORM_RTOL, LOSS_RTOL
from helpers.runs import STDLIB, Z3_PARTITION_ALL, metric_rows

SEQ = 32


def builtin_run(data: Path, run: Path, *extra: str) -> list[str]:
    return ["model.preset=tiny-moe", f"data.paths={data}", f"data.seq_len={SEQ}", "train.steps=2", "train.warmup_steps=0",
            "train.lr=3e-3", "checkpoint.every=2", "run.device=cpu", f"run.dir={run}", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def moe_run(small_dataset, tmp_path_factory):
    """fsdp at world 2 with each rank holding 4 of the 8 experts (parallel.ep=2): a DCP
    checkpoint whose expert tensors were DTensors sharded on the expert dimension, the
    hardest for an export to read whole (a one-process checkpoint reads the same way)."""
    run = tmp_path_factory.mktemp("moe-export") / "fsdp-ep2"
    extra = ["train.micro_batch=1", "parallel.strategy=fsdp", "parallel.ep=2"]
    check(train(builtin_run(small_dataset, run, *extra), nproc=2))
    return run


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of ids[:, 1:] from the logits at ids[:, :-1]: no auxiliary term."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_tiny_moe_checkpoint_exports_as_a_mixtral_transformers_loads_with_the_same_loss(moe_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scaletrain.models.llama import Llama

    run, out = moe_run, tmp_path / "hf"
    ckpt = run / "checkpoints" / "step_2"
    proc = check(scaletrain(["ckpt", "export", str(run), str(out), "--dtype", "fp32"]))
    # 4 blocks x (4 attention + 2 norms + router + 3 x 8 experts) + embedding + final norm (head tied).
    assert "126 tensors" in proc.stdout, proc.stdout
    config = json.loads((out / "config.json").read_text())
    shape = ModelShape(**json.loads((ckpt / "trainer.json").read_text())["model"])
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    want = {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 384, "hidden_size": 128,
            "router_aux_loss_coef": 0.02, "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}  # fmt: skip
    assert {k: config[k] for k in want} == want

    weights = read_model_weights(ckpt)
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(theirs).__name__ == "MixtralForCausalLM"
    ours = Llama(shape, max_seq_len=SEQ)
    ours.load_state_dict(weights)
    text = (STDLIB / "json" / "decoder.py").read_text()
    ids = torch.tensor([AutoTokenizer.from_pretrained(str(out)).encode(text)[: SEQ + 1]])
    with torch.no_grad():
        logits, _aux = ours(ids[:, :-1])
        hf_logits = theirs(ids[:, :-1]).logits
    # fp32 both sides, the same weights (an fp32 export slices and transposes, no arithmetic):
    # only summation order differs (SDPA, RMSNorm's mean, grouped_mm against one matmul per
    # expert, the top-k sum), a few ulps of logits of size ~2: atol 1e-5 is ~100 ulps
    # (measured <= 4.8e-7). The cross entropy's gradient in the logits (softmax - one-hot)
    # has an L1 norm <= 2 per token, so the loss moves by <= 2 x 1e-5 (measured 0). A
    # routing the export got wrong (an expert, a projection, the renormalization) is off by
    # orders of magnitude more.
    torch.testing.assert_close(hf_logits, logits, rtol=0, atol=1e-5)
    assert abs(lm_loss(hf_logits, ids).item() - lm_loss(logits, ids).item()) <= 2e-5
    # Trained routers: the tokens do not all go to the same experts.
    routed = ours.layers[0].feed_forward.router(ours.tok_embeddings(ids)).topk(2).indices
    assert routed.unique().numel() >= 4


def refused_shape(**moe) -> ModelShape:
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=64, tie_embeddings=True,
                rope_theta=10000.0, norm_eps=1e-5, experts=4, top_k=2, expert_ffn_dim=64)  # fmt: skip
    return ModelShape(**(base | moe))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("moe", "named"),
    [
        ({"shared_experts": 2, "dense_layers": 1}, ["model.moe.shared_experts=2", "model.moe.dense_layers=1"]),
        ({"normalize_top_k": False}, ["model.moe.normalize_top_k=false"]),
        ({"capacity_factor": 1.25}, ["model.moe.capacity_factor=1.25"]),
    ],
)
def test_what_mixtral_cannot_express_is_named_in_one_line(moe, named):
    with pytest.raises(UserError) as err:
        export_target(LlamaSpec(refused_shape(**moe)), 16)
    message = str(err.value)
    assert "\n" not in message and "no Hugging Face Mixtral equivalent" in message, message
    assert all(n in message for n in named) and "accepted: a mixture of experts with shared_experts=0" in message


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_an_export_of_unnormalized_routing_is_refused_in_one_line(moe_run, tmp_path):
    # normalize_top_k shapes no tensor, so only the run's config.yaml holds it: the same
    # checkpoint, its config saying the top-k weights were not renormalized.
    ckpt = tmp_path / "step_2"
    shutil.copytree(moe_run / "checkpoints" / "step_2", ckpt)
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    config["model"]["moe"] = {"normalize_top_k": False}
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config))
    proc = scaletrain(["ckpt", "export", str(ckpt), str(tmp_path / "hf")])
    one_line_error(proc, "model.moe.normalize_top_k=false has no Hugging Face Mixtral equivalent", "accepted:")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


# ---------------------------------------------------------------------------- HF models

# output_router_logits: transformers (and so training here) adds router_aux_loss_coef x
# its load-balancing term to the loss (here its gradient; the value logged stays the cross entropy).
# Qwen2-MoE besides: a shared expert, top-k weights not renormalized (its default).
QWEN2_MOE = {"model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": 24, "intermediate_size": 48,
             "shared_expert_intermediate_size": 32}  # fmt: skip
# Qwen3-MoE: no shared expert, top-k weights renormalized, and per-head RMSNorm of q and k.
QWEN3_MOE = {"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 24, "intermediate_size": 48,
             "norm_topk_prob": True, "head_dim": 8}  # fmt: skip
HF_MOE = {"mixtral": {"model_type": "mixtral", "num_local_experts": 4, "intermediate_size": 48}, "qwen2_moe": QWEN2_MOE,
          "qwen3_moe": QWEN3_MOE}  # fmt: skip
COMMON = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "num_experts_per_tok": 2, "output_router_logits": True,
          "router_aux_loss_coef": 0.02}  # fmt: skip
ENGINES = {
    # The decoder layers wrapped for activation checkpointing too: the routers run again in
    # backward, and their logits must not be recorded twice.
    "mixtral-fsdp": ("mixtral", ["parallel.strategy=fsdp", "parallel.activation_checkpointing=true"]),
    "mixtral-zero3": ("mixtral", ["parallel.strategy=zero3", Z3_PARTITION_ALL]),
    "qwen3_moe-zero3": ("qwen3_moe", ["parallel.strategy=zero3", Z3_PARTITION_ALL]),
    # Expert parallel (models/hf_experts.py): each rank holds 2 of the 4 stacked experts and
    # sends each token slot to its expert's rank; Qwen2-MoE's shared expert stays whole (fsdp
    # without ep: Mixtral above).
    "qwen3_moe-fsdp-ep2": ("qwen3_moe", ["parallel.strategy=fsdp", "parallel.ep=2", "parallel.activation_checkpointing=true"]),
    "qwen2_moe-fsdp-ep2": ("qwen2_moe", ["parallel.strategy=fsdp", "parallel.ep=2"]),
}
HF_STEPS = 3


def hf_run(model_dir: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return ["model.source=hf", f"model.path={model_dir}", f"data.paths={data}", f"data.seq_len={SEQ}",
            f"train.steps={HF_STEPS}", "train.micro_batch=2", "train.warmup_steps=0", "train.lr=1e-2",
            f"checkpoint.every={HF_STEPS}", "run.device=cpu", f"run.dir={run}", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def hf_moe(small_dataset, tmp_path_factory):
    """Each architecture saved by save_pretrained (bf16, the vocabulary of the data's
    tokenizer, which goes along as the model's own), and its one-process run at micro-batch
    2 x 2 accumulated: the micro-batches of two ranks of 2, so each balance term (per
    micro-batch, as transformers computes it) sees the same tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hf-moe")
    vocab = json.loads((small_dataset / "manifest.json").read_text())["vocab_size"]
    made = {}
    for arch, fields in HF_MOE.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**(fields | COMMON | {"vocab_size": vocab})))
        model.to(torch.bfloat16).save_pretrained(str(root / arch))
        shutil.copyfile(small_dataset / "tokenizer.json", root / arch / "tokenizer.json")
        check(train(hf_run(root / arch, small_dataset, root / f"{arch}-ref", "train.grad_accum=2")))
        made[arch] = (root / arch, root / f"{arch}-ref", model.float())
    return made


def losses_and_norms(run: Path) -> tuple[list[float], list[float]]:
    rows = metric_rows(run)
    assert len(rows) == HF_STEPS
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(ENGINES))
def test_an_hf_mixture_of_experts_trains_at_world_2_as_in_one_process(hf_moe, small_dataset, tmp_path, case):
    arch, engine = ENGINES[case]
    model_dir, reference, _ = hf_moe[arch]
    check(train(hf_run(model_dir, small_dataset, tmp_path / case, *engine), nproc=2))
    (ref_loss, ref_norm), (loss, norm) = losses_and_norms(reference), losses_and_norms(tmp_path / case)
    # The standing tolerances (helpers/numerics.py): each rank's micro-batch is one of the reference's,
    # routed to the same experts, so only summation order differs, and Adam's amplification
    # of it after step 1. Measured: equal losses, grad norms <= 2e-7 apart (relative).
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    np.testing.assert_allclose(norm, ref_norm, rtol=GRAD_NORM_RTOL)
    assert ref_loss[-1] < ref_loss[0]


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", list(HF_MOE))
def test_the_first_loss_is_the_saved_models_own_cross_entropy(hf_moe, arch):
    from scaletrain.config import load_config
    from scaletrain.data import PackedTokens, RankBatches, resolve_dataset_dir

    model_dir, reference, saved = hf_moe[arch]
    cfg = load_config([str(reference / "config.yaml")])
    assert cfg.data.tokenizer == str(model_dir / "tokenizer.json")  # the model's own
    data_dir, _ = resolve_dataset_dir(cfg.data)
    batches = RankBatches(PackedTokens(data_dir, SEQ, cfg.train.seed), 2, 2, 0, 1).next_step()
    coef = saved.config.router_aux_loss_coef
    with torch.no_grad():
        ce, balance = [], []
        for inputs, targets in batches:
            out = saved(inputs)
            ce.append(torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten()).item())
            balance.append(coef * out.aux_loss.item())
    # Loaded, not initialized: the expert tensors, saved one per expert, were stacked as
    # the model holds them. Same weights and code: fp32 rounding of the sums only.
    # The logged loss is the cross entropy alone (the balance term trains through its
    # gradient only: test_the_balance_term_reaches_the_gradient_and_not_the_loss_value).
    got = losses_and_norms(reference)[0][0]
    np.testing.assert_allclose(got, np.mean(ce), rtol=1e-6)
    assert np.mean(balance) > 1000 * 1e-6 * got  # with the term in it, the value would be off by far more


@pytest.mark.unit
@pytest.mark.parametrize("arch", list(HF_MOE))
def test_an_hf_mixture_of_experts_flops_count_the_experts_each_token_runs_through(arch):
    # transformers stacks each layer's experts in 3-D tensors ([E, out, in]): per token, the
    # top-k of the E experts multiply (3 x hidden x expert width each, per MoE layer), not
    # none of them (a count of 2-D weights alone) and not all of them.
    from scaletrain.config import load_config
    from scaletrain.models import model_spec

    conf = {**COMMON, **HF_MOE[arch], "vocab_size": 64}
    spec = model_spec(load_config([], ["model.source=hf", f"model.hf_config={json.dumps(conf)}"]), 64)
    width = conf.get("moe_intermediate_size", conf["intermediate_size"])
    experts = conf.get("num_local_experts", conf.get("num_experts"))
    per_layer = 3 * conf["hidden_size"] * width
    counts = spec.counts()
    assert counts.experts == conf["num_hidden_layers"] * experts * per_layer
    head_dim = conf.get("head_dim", conf["hidden_size"] // conf["num_attention_heads"])
    attention = 12 * conf["num_hidden_layers"] * conf["num_attention_heads"] * head_dim * SEQ
    active = conf["num_hidden_layers"] * conf["num_experts_per_tok"] * per_layer
    assert spec.flops_per_token(SEQ) == 6 * (counts.matmul + active) + attention


@pytest.mark.unit
def test_the_balance_term_reaches_the_gradient_and_not_the_loss_value():
    from types import SimpleNamespace

    from scaletrain.config import load_config
    from scaletrain.models import model_spec

    conf = {**COMMON, **HF_MOE["mixtral"], "vocab_size": 64, "router_aux_loss_coef": 0.25}
    spec = model_spec(load_config([], ["model.source=hf", f"model.hf_config={json.dumps(conf)}"]), 64)
    logits = torch.randn(2, 3, 64)
    targets = torch.randint(0, 64, (2, 3))
    aux = torch.tensor(1.5, requires_grad=True)
    loss = spec.loss(SimpleNamespace(logits=logits, aux_loss=aux), targets)
    assert torch.equal(loss, spec.loss(logits, targets))  # the value: the cross entropy
    loss.backward()
    assert aux.grad == 0.25  # the gradient: router_aux_loss_coef x the term's


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_trained_hf_mixtral_exports_back_and_loads(hf_moe, tmp_path):
    from transformers import AutoModelForCausalLM

    _, reference, _ = hf_moe["mixtral"]
    out = tmp_path / "hf"
    check(scaletrain(["ckpt", "export", str(reference), str(out), "--dtype", "fp32"]))
    trained = read_model_weights(reference / "checkpoints" / f"step_{HF_STEPS}")
    again = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(again).__name__ == "MixtralForCausalLM"
    params = dict(again.named_parameters())
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight"):
        assert torch.equal(params[name], trained[name]), name


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_lora_on_an_hf_mixture_of_experts_with_expert_parallel_is_one_process_and_exports_the_same(
    hf_moe, small_dataset, tmp_path
):
    # Adapters on attention and on each layer's router (`gate`), the stacked experts frozen
    # and split over ep 2: the same training as one process at the same global batch, and
    # the merged export the same tensors. Measured: equal losses and grad norms, to the bit.
    from safetensors.torch import load_file

    model_dir, _, _ = hf_moe["qwen3_moe"]
    lora = "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj, gate]}"
    one, ep = tmp_path / "one", tmp_path / "ep2"
    check(train(hf_run(model_dir, small_dataset, one, lora, "train.grad_accum=2")))
    check(train(hf_run(model_dir, small_dataset, ep, lora, "parallel.strategy=fsdp", "parallel.ep=2"), nproc=2))
    (ref_loss, ref_norm), (loss, norm) = losses_and_norms(one), losses_and_norms(ep)
    # The standing tolerances, as for the runs without LoRA above.
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    np.testing.assert_allclose(norm, ref_norm, rtol=GRAD_NORM_RTOL)
    exported = {}
    for run in (one, ep):
        check(scaletrain(["ckpt", "export", str(run / "checkpoints" / f"step_{HF_STEPS}"), str(run / "hf"), "--dtype", "fp32"]))
        exported[run.name] = load_file(str(next((run / "hf").glob("*.safetensors"))))
    assert sorted(exported["one"]) == sorted(exported["ep2"])
    assert any(".experts." in name for name in exported["ep2"]) and not any("lora" in name for name in exported["ep2"])
    for name, want in exported["one"].items():
        # Adam's amplification of the summation order's rounding over 3 steps (lr 1e-2).
        torch.testing.assert_close(exported["ep2"][name], want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.unit
def test_expert_parallel_an_hf_model_cannot_take_is_one_line_naming_its_model_type():
    from scaletrain.config import load_config
    from scaletrain.models import model_spec
    from scaletrain.models.capabilities import ExpertSplit

    def refusal(fields: dict, ep: int, *extra: str) -> str:
        inline = json.dumps(fields | COMMON | {"vocab_size": 64})
        spec = model_spec(load_config([], ["model.source=hf", f"model.hf_config={inline}", *extra]), None)
        assert isinstance(spec, ExpertSplit)  # what engines/fsdp.py asks for the split
        with pytest.raises(UserError) as err:
            spec.check_ep(ep)
        assert "\n" not in str(err.value)
        return str(err.value)

    said = refusal({"model_type": "llama", "intermediate_size": 48}, 2)
    assert said.startswith("parallel.ep=2 splits a mixture of experts' experts") and "model_type llama has none" in said
    said = refusal(QWEN3_MOE, 3)
    assert "parallel.ep=3 must divide model_type qwen3_moe's 4 experts per layer; accepted: parallel.ep=1, 2, 4" in said
    # The config takes an HF model's ep (on fsdp): its spec decides at build, as above.
    load_config([], ["model.source=hf", "model.hf_config={model_type: mixtral}", "parallel.strategy=fsdp", "parallel.ep=2"])


@pytest.mark.unit
def test_the_local_experts_of_an_hf_model_under_ep_are_the_same_grouped_or_looped():
    # models/hf_experts.py runs a rank's experts as two grouped products over transformers'
    # stacked weights (transposed views) where torch's kernel runs, else one expert at a
    # time as transformers' eager forward; both the same, an expert without slots included.
    from transformers import AutoConfig, AutoModelForCausalLM

    from scaletrain.models.hf_experts import _local_experts, stacked_experts

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**(QWEN3_MOE | COMMON | {"vocab_size": 64})))
    experts = stacked_experts(model)[0]
    splits = [3, 0, 5, 2]  # slots per expert, sorted by expert
    slots = torch.randn(sum(splits), COMMON["hidden_size"])
    counts = torch.tensor(splits)
    got = {}
    for impl in ("loop", "grouped"):
        experts.experts_impl = impl
        x = slots.clone().requires_grad_()
        out = _local_experts(experts, x, counts, splits)
        grads = torch.autograd.grad(out.square().sum(), [x, experts.gate_up_proj, experts.down_proj])
        got[impl] = (out, *grads)
    # The same products over the same rows, grouped by another kernel: fp32 rounding of
    # sums of 24-32 terms (~1e-6 relative); the weights' gradients summed over 0-5 rows.
    for looped, grouped in zip(got["loop"], got["grouped"]):
        torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5 * looped.abs().max().item())
    assert not got["grouped"][2][1].any() and not got["grouped"][3][1].any()  # expert 1 had no slot: no gradient
