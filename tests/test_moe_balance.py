"""DeepSeek-V3's routing in the built-in mixture of experts (models/moe.py): sigmoid scores,
group-limited routing, and the auxiliary-loss-free balance (model.moe.balance=bias), whose
bias is moved from each step's load over every micro-batch and rank, saved in trainer.json,
and so trains the same numbers however the step is split, resumes bit for bit and evaluates
as it trained."""

from __future__ import annotations

import json

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.errors import UserError
from scaletrain.models.moe import ExpertBias, MoE
from scaletrain.models.presets import resolve_shape
from scaletrain.models.spec import LlamaSpec
from scaletrain.telemetry.metrics import read_metrics

from helpers.launch import check, one_line_error, scaletrain, train
from helpers.numerics import assert_bit_exact, assert_same_training
from helpers.runs import base_overrides, copy_until, eval_overrides, eval_rows

V3 = ["model.moe.score=sigmoid", "model.moe.groups=4", "model.moe.topk_groups=2"]


def _moe(*overrides: str) -> MoE:
    torch.manual_seed(0)
    shape = resolve_shape(
        load_config([], ["model.preset=tiny-moe", "model.dim=16", "model.n_heads=2", "model.n_kv_heads=2", *overrides]).model, 64
    )
    layer = MoE(shape)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def _reference(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """Token by token, as DeepSeek-V3's gate reads: sigmoid scores, plus the bias for the
    choice; the groups ranked by the sum of their best two choice scores, the top_k experts
    among the best topk_groups groups, weighted by their scores (not the bias), renormalized."""
    out, picks = torch.zeros_like(x), []
    per_group = layer.n_experts // layer.groups
    bias = layer.expert_bias if layer.expert_bias is not None else torch.zeros(layer.n_experts)
    for i, token in enumerate(x):
        scores = layer.router(token).float().sigmoid()
        choice = (scores + bias).tolist()
        group_score = [sum(sorted(choice[g * per_group : (g + 1) * per_group])[-2:]) for g in range(layer.groups)]
        groups = sorted(range(layer.groups), key=lambda g: -group_score[g])[: layer.topk_groups]
        allowed = [e for e in range(layer.n_experts) if e // per_group in groups]
        chosen = sorted(allowed, key=lambda e: -choice[e])[: layer.top_k]
        weights = scores[chosen] / scores[chosen].sum()
        for w, e in zip(weights, chosen):
            ex = layer.experts
            out[i] += w * (torch.nn.functional.silu(token @ ex.w1[e]) * (token @ ex.w3[e])) @ ex.w2[e]
        picks.append(sorted(chosen))
    return out, picks


@pytest.mark.unit
@pytest.mark.parametrize("biased", [False, True])
def test_group_limited_sigmoid_routing_is_deepseek_v3s_gate_and_the_bias_only_chooses(biased):
    layer = _moe(*V3, "model.moe.balance=bias")
    if biased:  # large enough to pull expert 5 (group 2) into every token's choice, and nothing else
        layer.expert_bias = torch.tensor([0.0, 0, 0, 0, 0, 3.0, 0, 0])
    x = torch.randn(24, 16)
    out, _, _ = layer(x[None])
    want, picks = _reference(layer, x)
    # Summation order only: fp32 dot products over the expert width (384) in another order,
    # about sqrt(384) x 1.2e-7 ~ 2.4e-6 of the outputs' scale; 1e-5 of it allowed. A wrong
    # routing (another expert, a weight with the bias in it) is off by the scale itself.
    torch.testing.assert_close(out[0], want, rtol=0, atol=1e-5 * want.abs().max().item())
    groups = [{e // 2 for e in chosen} for chosen in picks]
    assert all(len(g) <= 2 for g in groups)  # topk_groups=2 of 4
    assert any(len(g) == 2 for g in groups)  # and the limit is not vacuous: some take two
    if biased:
        assert all(5 in chosen for chosen in picks)


@pytest.mark.unit
def test_the_bias_moves_against_the_whole_steps_load_summed_over_ranks():
    spec = LlamaSpec(resolve_shape(load_config([], ["model.preset=tiny-moe"]).model, 64))
    model = spec.build_meta(16)
    model.to_empty(device="cpu")
    seen = []

    def reduce(load: torch.Tensor) -> None:  # another rank that saw the mirror image of this one's load
        seen.append(load.clone())
        load.add_(load.flip(1) * 3)

    bias = ExpertBias(model, rate=0.01, device=torch.device("cpu"), reduce=reduce)
    assert all(layer.expert_bias is not None for layer in bias_layers(model))
    load = torch.zeros(4, 8, dtype=torch.float64)
    load[:, 0], load[:, 1], load[:, 7] = 10, 5, 2  # with the other rank's: 16, 5, 0, 0, 0, 0, 15, 32 (mean 8.5)
    model.moe_load.copy_(load)
    bias.after_step()
    total = load + load.flip(1) * 3
    want = 0.01 * torch.sign(total.mean(1, keepdim=True) - total).float()
    torch.testing.assert_close(bias.table, want, rtol=0, atol=0)
    assert torch.equal(seen[0], load) and model.moe_load.abs().sum() == 0  # reduced once, then cleared
    # Whatever the step's size: sign only. A load exactly at the mean leaves the bias.
    model.moe_load.fill_(7.0)
    bias.after_step()
    torch.testing.assert_close(bias.table, want, rtol=0, atol=0)
    # trainer.json's list of lists, back: exactly; another model's table is one line.
    restored = ExpertBias(model, 0.01, torch.device("cpu"), lambda t: None)
    restored.load(json.loads(json.dumps(bias.state())))
    assert torch.equal(restored.table, bias.table)
    with pytest.raises(UserError, match="MoE layers x experts"):
        restored.load([[0.0] * 8] * 3)


@pytest.mark.e2e  # a unit by its scope; with the runs for its compile time (20-50 s here)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_compiled_block_routes_with_the_bias_as_it_moves():
    # The bias is a plain tensor attribute, moved in place between steps: a compiled block must
    # read it as an input each call, not bake in the values it saw when it was traced.
    layer = _moe(*V3, "model.moe.balance=bias", "model.moe.experts_impl=grouped")
    layer.expert_bias = table = torch.zeros(8)
    x = torch.randn(1, 24, 16)
    compiled = torch.compile(layer, fullgraph=True)
    before = layer(x)[0]
    torch.testing.assert_close(compiled(x)[0], before, rtol=0, atol=1e-5 * before.abs().max().item())
    table[5] = 3.0  # as ExpertBias.after_step moves it: in place
    after = layer(x)[0]
    assert not torch.allclose(after, before)  # the move changed the routing
    torch.testing.assert_close(compiled(x)[0], after, rtol=0, atol=1e-5 * after.abs().max().item())


def bias_layers(model: torch.nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["model.moe.groups=3"], "groups dividing model.moe.experts (1, 2, 4, 8)"),
        (["model.moe.groups=4", "model.moe.topk_groups=5"], "1 <= topk_groups <= groups"),
        (["model.moe.groups=8", "model.moe.topk_groups=1"], "top_k <= 1"),
    ],
)
def test_a_group_limit_that_cannot_route_is_one_line(overrides, said):
    with pytest.raises(UserError, match=said.replace("(", r"\(").replace(")", r"\)")):
        resolve_shape(load_config([], ["model.preset=tiny-moe", *overrides]).model, 64)


STEPS = 8
# A rate that moves the bias past the gaps between the sigmoid scores within a few steps:
# with DeepSeek-V3's 0.001 eight steps of tiny-moe would route as without it, and a test of
# the bias would pass by construction.
BIAS = ["model.preset=tiny-moe", "model.moe.balance=bias", "model.moe.bias_update_rate=0.05", *V3]


@pytest.fixture(scope="module")
def one_process(small_dataset, tmp_path_factory):
    run = tmp_path_factory.mktemp("bias-ref") / "w1"
    overrides = [*base_overrides(small_dataset, run, steps=STEPS), *BIAS, "train.micro_batch=8", "checkpoint.every=4"]
    check(train([*overrides, *eval_overrides(small_dataset)]))
    return run


def _bias(run, step=STEPS):
    return json.loads((run / "checkpoints" / f"step_{step}" / "trainer.json").read_text())["expert_bias"]


LAYOUTS = {
    # One process, the step's 8 sequences as 4 micro-batches of 2: the load is summed over them.
    "accumulation": (1, ["train.micro_batch=2", "train.grad_accum=4"]),
    "ddp": (2, ["parallel.strategy=ddp", "train.micro_batch=4"]),
    # Each rank holds 4 of the 8 experts (two of the four groups); tokens travel by all-to-all.
    "fsdp-ep2": (2, ["parallel.strategy=fsdp", "parallel.ep=2", "train.micro_batch=4"]),
}


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_bias_trains_the_same_numbers_however_the_step_is_split(one_process, small_dataset, tmp_path, layout):
    nproc, args = LAYOUTS[layout]
    run = tmp_path / layout
    check(train([*base_overrides(small_dataset, run, steps=STEPS), *BIAS, *args, *eval_overrides(small_dataset)], nproc=nproc))
    # The standing tolerances (helpers/numerics.py): summation order only, as every token meets the
    # same experts, chosen with the same bias, on whichever rank and micro-batch it sits.
    assert_same_training(run, one_process, steps=STEPS)
    # The loads are whole slot counts, so the bias (a sum of +-rate steps) is exactly the same.
    want = _bias(one_process)
    assert _bias(run) == want
    # And it moved, unevenly in every layer (a bias the same for every expert would not
    # change any choice).
    assert all(len(set(row)) > 1 for row in want), want
    # Each interval row carries the bias the next step routes with: the last one, the checkpoint's.
    intervals = [r for r in read_metrics(run / "metrics.jsonl", events=True) if r.get("event") == "interval"]
    assert intervals[-1]["step"] == STEPS and all("bias" in layer for r in intervals for layer in r["moe"]["layers"])
    logged = [layer["bias"] for layer in intervals[-1]["moe"]["layers"]]
    assert len(logged) == len(want) and all(got == pytest.approx(row, abs=1e-6) for got, row in zip(logged, want))


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(400)
def test_the_bias_moves_the_same_in_a_pipeline(small_dataset, tmp_path):
    """pp 2 at world 2, each stage's ranks counting its own layers' rows of the load: the
    sum over every rank is the whole step's load of every layer, so both stages move the
    whole table as one process does. (Untied embeddings, which a pipeline needs.)"""
    base = [*BIAS, "model.tie_embeddings=false", "checkpoint.every=4"]
    ref, run = tmp_path / "one", tmp_path / "pp2"
    check(train([*base_overrides(small_dataset, ref, steps=STEPS), *base, "train.micro_batch=8", *eval_overrides(small_dataset)]))
    pp = ["parallel.strategy=fsdp", "parallel.pp=2", "parallel.pp_schedule=1f1b", "train.micro_batch=4", "train.grad_accum=2"]
    check(train([*base_overrides(small_dataset, run, steps=STEPS), *base, *pp, *eval_overrides(small_dataset)], nproc=2))
    assert_same_training(run, ref, steps=STEPS)
    want = _bias(ref)
    assert _bias(run) == want and all(len(set(row)) > 1 for row in want)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_resume_restores_the_bias_and_eval_routes_with_it(one_process, small_dataset, tmp_path):
    resumed = tmp_path / "resumed"
    copy_until(one_process, resumed, 4)
    overrides = [*base_overrides(small_dataset, resumed, steps=STEPS), *BIAS, "train.micro_batch=8", "checkpoint.every=4"]
    check(train([*overrides, *eval_overrides(small_dataset)]))
    assert_bit_exact(resumed, one_process, STEPS)
    assert _bias(resumed) == _bias(one_process) and _bias(one_process, 4) != _bias(one_process)
    # `scaletrain eval` of the last checkpoint routes with its bias: the run's own last evaluation.
    ckpt = one_process / "checkpoints" / f"step_{STEPS}"
    out = check(scaletrain(["eval", str(ckpt), *eval_overrides(small_dataset)])).stdout
    want = eval_rows(one_process)[-1]
    assert want["step"] == STEPS and f"loss {want['loss']:.6f}" in out, (want, out)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_exporting_a_biased_router_as_mixtral_is_one_line(one_process, tmp_path):
    ckpt = one_process / "checkpoints" / f"step_{STEPS}"
    proc = scaletrain(["ckpt", "export", str(ckpt), str(tmp_path / "hf"), "--format", "hf"])
    one_line_error(proc, "model.moe.score=sigmoid", "topk_groups=2 of groups=4", "model.moe.balance=bias")
