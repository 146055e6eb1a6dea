"""Mixture of experts in the built-in model (models/moe.py): the routing computes what its
definition says, the presets have their published sizes, tiny-moe learns, and it trains on
ddp, fsdp and zero3 at world 2 equal to one process."""

from __future__ import annotations

import math

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.config.parallel import parallel_dims
from scaletrain.errors import UserError
from scaletrain.models.moe import STAT_DROPPED, MoE
from scaletrain.models.presets import resolve_shape
from scaletrain.models.spec import LlamaSpec
from scaletrain.telemetry.metrics import read_metrics

from helpers.launch import check, train
from helpers.numerics import assert_same_training
from helpers.runs import base_overrides, eval_overrides


def _shape(*overrides: str, vocab: int | None = None):
    return resolve_shape(load_config([], list(overrides)).model, vocab)


def _moe(*overrides: str, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(_shape("model.preset=tiny-moe", "model.dim=16", "model.n_heads=2", "model.n_kv_heads=2", *overrides, vocab=64))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def _reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, as the definition reads: its top-k experts' SwiGLU outputs, weighted."""
    out = torch.zeros_like(x)
    for i, token in enumerate(x):
        probs = layer.router(token).float().softmax(-1)
        weights, chosen = probs.topk(layer.top_k)
        if layer.normalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, chosen.tolist()):
            ex = layer.experts
            expert = (torch.nn.functional.silu(token @ ex.w1[e]) * (token @ ex.w3[e])) @ ex.w2[e]
            out[i] += w * expert
    return out


@pytest.mark.unit
@pytest.mark.parametrize("overrides", [(), ("model.moe.shared_experts=1", "model.moe.normalize_top_k=false")])
def test_the_routed_output_is_each_tokens_top_k_experts_weighted(overrides):
    layer = _moe(*overrides)
    x = torch.randn(2, 5, 16)
    y, aux, stats = layer(x)
    want = _reference(layer, x.reshape(-1, 16))
    if layer.shared is not None:
        want = want + layer.shared(x.reshape(-1, 16))
    # fp32 sums of at most top_k products in another order: a few ulps of values ~1.
    torch.testing.assert_close(y.reshape(-1, 16), want, rtol=1e-5, atol=1e-5)
    assert int(stats[: layer.n_experts].sum()) == 10 * layer.top_k
    assert aux.shape == () and aux.item() > 0


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity", ["0", "0.5"])
def test_the_grouped_matmul_path_gives_the_loops_numbers(dtype, capacity):
    """model.moe.experts_impl=grouped (one torch._grouped_mm per projection) against loop
    (one matmul per expert): outputs and gradients, an expert with no token included, and
    under a capacity the dropped slots (rows past the grouped kernel's last offset, which
    it leaves unwritten) neither in the output nor in any gradient."""
    runs = []
    for impl in ("loop", "grouped"):
        layer = _moe(f"model.moe.experts_impl={impl}", f"model.moe.capacity_factor={capacity}").to(dtype)
        with torch.no_grad():
            layer.router.weight[3] = -50  # expert 3 never chosen: an empty group
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)).abs().to(dtype)  # positive: row 3 scores lowest
        x.requires_grad_(True)
        y, aux, stats = layer(x)
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)).sum().add(aux).backward()
        runs.append((y, [x.grad, *(p.grad for p in layer.parameters())], stats))
    assert runs[0][2][3] == 0 and torch.equal(runs[0][2], runs[1][2])
    assert (runs[0][2][layer.n_experts + STAT_DROPPED] > 0) == (capacity != "0")
    # Each output row, and each gradient entry, is the same sum of products (over the
    # model width, the expert width, or an expert's rows) in whatever order each kernel
    # blocks it: torch's CPU grouped kernel runs one matmul per group, the loop one per
    # expert, so the sums may be ordered differently, by a few ulps of the largest term
    # (fp32: 6e-8 each, 16-48 terms per sum here; bf16 rounds to 8 bits).
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(runs[1][0], runs[0][0], **tol)
    for got, want in zip(runs[1][1], runs[0][1]):
        assert torch.isfinite(got).all()  # no unwritten row reached a gradient
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.unit
def test_both_paths_run_under_autocast_as_ddp_runs_bf16():
    # ddp's bf16 is autocast over fp32 weights and residual stream: the experts' products
    # come out in bf16 (the grouped kernel, on no autocast list, is cast to it as the
    # loop's matmuls are) and are summed into the fp32 tokens.
    runs = []
    for impl in ("loop", "grouped"):
        layer = _moe(f"model.moe.experts_impl={impl}")
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, aux, _ = layer(x)
        (y.sum() + aux).backward()
        assert y.dtype == torch.float32 and layer.experts.w1.grad.dtype == torch.float32
        runs.append([y, x.grad, layer.experts.w1.grad])
    for got, want in zip(*reversed(runs)):
        # The same bf16 products, rounded to 8-bit mantissas at each step (kernels may round
        # an intermediate differently): a few of bf16's 2^-8 relative steps of the largest value.
        torch.testing.assert_close(got, want, rtol=0, atol=2**-5 * want.abs().max().item())


@pytest.mark.unit
def test_the_balance_loss_is_one_when_balanced_and_its_gradient_reaches_the_router():
    layer = _moe("model.moe.z_loss_weight=0", "model.moe.aux_loss_weight=1")
    with torch.no_grad():
        layer.router.weight.zero_()  # uniform probabilities; top-k then takes the first experts
    _, aux, _ = layer(torch.randn(1, 8, 16))
    # f = top_k/E... on the experts taken, P = 1/E everywhere: E x sum_e f_e / E = 1 exactly.
    assert aux.item() == pytest.approx(1.0, rel=1e-6)
    layer = _moe("model.moe.z_loss_weight=0", "model.moe.aux_loss_weight=1")
    _, aux, _ = layer(torch.randn(1, 8, 16))
    aux.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    assert layer.experts.w1.grad is None  # the balance term depends on the router only


def _switch(probs: torch.Tensor, k: int) -> torch.Tensor:
    """The Switch balance term of these tokens' router probabilities [tokens, experts]."""
    e = probs.shape[1]
    share = torch.bincount(probs.topk(k, -1).indices.reshape(-1), minlength=e).float() / (probs.shape[0] * k)
    return e * (share * probs.mean(0)).sum()


@pytest.mark.unit
@pytest.mark.parametrize("balance", ["sequence_aux", "aux"])
def test_the_models_loss_carries_the_routers_auxiliary_gradient_and_the_cross_entropy_as_its_value(balance):
    """The spec's loss adds each layer's auxiliary terms, gradient included: the router's
    gradient with the terms on, minus with them off (the forward is the same), equals the
    gradient of the terms written out here from their definitions (one MoE block, so the
    router's input does not itself depend on a router): the balance term over each sequence
    and averaged (sequence_aux) or over the micro-batch (aux). Its value is the cross
    entropy alone, the same with the terms on or off."""
    over = ["model.preset=tiny-moe", "model.n_layers=1", "model.dim=32", "model.n_heads=2", "model.n_kv_heads=2"]
    inputs, captured, grads, values = torch.randint(0, 64, (2, 9)), {}, {}, {}
    for weights in ((0.0, 0.0), (0.5, 0.25)):
        spec = LlamaSpec(
            _shape(
                *over, f"model.moe.aux_loss_weight={weights[0]}", f"model.moe.z_loss_weight={weights[1]}",
                f"model.moe.balance={balance}", vocab=64,
            )
        )  # fmt: skip
        model = spec.build_meta(8)
        spec.materialize(model, torch.device("cpu"), seed=0)
        (layer,) = [m for m in model.modules() if isinstance(m, MoE)]
        layer.register_forward_hook(lambda _m, args, _out: captured.update(x=args[0].detach()))
        loss = spec.loss(model(inputs[:, :-1]), inputs[:, 1:])
        (grads[weights],) = torch.autograd.grad(loss, [layer.router.weight])
        values[weights] = loss.item()
    assert values[(0.5, 0.25)] == values[(0.0, 0.0)]  # bit for bit: aux - aux.detach() adds exactly 0
    router = layer.router.weight.detach().clone().requires_grad_()
    x = captured["x"]
    logits = (x @ router.t()).float()
    probs = logits.softmax(-1)  # [sequences, tokens, experts]
    if balance == "aux":
        term = _switch(probs.reshape(-1, probs.shape[-1]), layer.top_k)
    else:
        term = torch.stack([_switch(p, layer.top_k) for p in probs]).mean()
    terms = 0.5 * term + 0.25 * torch.logsumexp(logits, -1).pow(2).mean()
    (want,) = torch.autograd.grad(terms, [router])
    # The same fp32 operations in another grouping: rounding of values ~1e-2, so a few ulps
    # of the gradient's largest entry; a missing term is off by the whole of `want`.
    torch.testing.assert_close(grads[(0.5, 0.25)] - grads[(0.0, 0.0)], want, rtol=1e-4, atol=1e-6 * want.abs().max().item())
    assert want.abs().max() > 1e-3


@pytest.mark.unit
def test_a_capacity_drops_the_slots_past_it_in_token_order():
    layer = _moe("model.moe.capacity_factor=0.5")
    x = torch.randn(1, 16, 16)
    _, _, stats = layer(x)
    n, k, e = 16, layer.top_k, layer.n_experts
    capacity = math.ceil(0.5 * n * k / e)
    load = stats[:e]
    assert int(stats[e + STAT_DROPPED]) == int((load - capacity).clamp(min=0).sum()) > 0


@pytest.mark.unit
@pytest.mark.parametrize(
    "preset, total, active",
    [
        # Mixtral-8x7B as published (Hugging Face's count of its weights): 46,702,792,704;
        # active per token 12.9B. DeepSeekMoE-16B (its paper): 16.4B and 2.8B.
        ("mixtral-8x7b", 46_702_792_704, 12.9e9),
        ("deepseek-moe-16b", 16.4e9, 2.8e9),
        # Qwen3-30B-A3B: its model card says 30.5B and 3.3B active; its config.json's tensors
        # count 30,532,122,624, and 3.35B active with the embedding and head (48 x (attention
        # 18.9M + router 0.26M + 8 experts x 4.7M) + 0.62B): heads of 128 channels on a 2048
        # residual and the query/key norms included (a head of dim / n_heads = 64 would miss 7%).
        ("qwen3-moe-30b-a3b", 30_532_122_624, 3.35e9),
    ],
)
def test_the_planning_presets_have_their_published_total_and_active_parameters(preset, total, active):
    spec = LlamaSpec(_shape(f"model.preset={preset}"))
    if isinstance(total, int):
        assert spec.counts().total == total
    else:  # published to three figures
        assert spec.counts().total == pytest.approx(total, rel=0.005)
    assert spec.active_params() == pytest.approx(active, rel=0.015)
    # FLOPs per token count the active experts, not all of them (and no matmul for the
    # embedding lookup); the attention scores at seq 1 are negligible.
    assert spec.flops_per_token(1) == pytest.approx(6 * (spec.active_params() - spec.counts().embedding), rel=0.001)


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, said",
    [
        (["model.preset=tiny-moe", "parallel.strategy=zero2", "parallel.ep=2"], "DeepSpeed's expert parallel needs its own"),
        (["model.preset=tiny-moe", "parallel.strategy=ddp", "parallel.ep=2"], "accepted: parallel.strategy=fsdp"),
        (["model.preset=tiny", "parallel.strategy=fsdp", "parallel.ep=2"], "model.preset=tiny (dense) has none to split"),
        (["model.preset=tiny-moe", "parallel.strategy=fsdp", "parallel.ep=2", "train.compile=true"], "not built yet"),
    ],
)
def test_expert_parallel_where_it_is_not_is_one_line(overrides, said):
    with pytest.raises(UserError) as err:
        load_config([], overrides)
    assert said in str(err.value) and "\n" not in str(err.value)


@pytest.mark.unit
def test_ep_must_divide_the_experts_and_the_data_parallel_ranks():
    with pytest.raises(
        UserError, match=r"must divide the experts per layer \(8: model.moe.experts\); accepted: parallel.ep=1, 2, 4, 8"
    ):
        LlamaSpec(_shape("model.preset=tiny-moe", vocab=64)).check_ep(3)
    with pytest.raises(UserError, match="parallel.ep=4 must divide the data-parallel shard size 2 .*accepted: 1, 2"):
        parallel_dims("fsdp", 2, ep=4)
    dims = parallel_dims("fsdp", 4, ep=2)
    assert (dims.dp_shard, dims.ep, dims.dp_size) == (4, 2, 4)
    # Under context parallel the ep group holds whole cp groups: cp x a divisor of dp_shard.
    for ep in (3, 6):
        with pytest.raises(
            UserError, match=f"parallel.ep={ep} with parallel.cp=2 must be cp times a divisor .*accepted: 2, 4, 8$"
        ):
            parallel_dims("fsdp", 8, cp=2, ep=ep)
    dims = parallel_dims("fsdp", 8, cp=2, ep=4)
    assert (dims.dp_shard, dims.cp, dims.ep, dims.ep_in_shard, dims.dp_size) == (4, 2, 4, 2, 4)


STEPS = 8


@pytest.fixture(scope="module")
def one_process(small_dataset, tmp_path_factory):
    """World 1 with the step's 8 sequences in one micro-batch, where the runs at world 2 take 4
    on each rank: with the default balance (model.moe.balance=sequence_aux, per sequence) the
    numbers depend on the global batch only. The per-micro-batch balance (aux) fails this:
    its load counts, and so its gradient, follow how the sequences are grouped."""
    run = tmp_path_factory.mktemp("moe-ref") / "w1"
    overrides = [*base_overrides(small_dataset, run, steps=STEPS), "model.preset=tiny-moe", "train.micro_batch=8"]
    check(train([*overrides, "train.grad_accum=1", "checkpoint.every=4", *eval_overrides(small_dataset)]))
    return run


LAYOUTS = {
    "ddp": ["parallel.strategy=ddp"],
    "fsdp": ["parallel.strategy=fsdp"],
    "zero3": ["parallel.strategy=zero3"],
    # Each rank holds 4 of the 8 experts; tokens travel by all-to-all.
    "fsdp-ep2": ["parallel.strategy=fsdp", "parallel.ep=2"],
    # The same with the parameters (each rank's shard of its 4 experts too) and the
    # optimizer step on the host: on a CPU nothing moves, the offloaded path runs.
    "fsdp-ep2-offload": ["parallel.strategy=fsdp", "parallel.ep=2", "parallel.offload_params=cpu"],
    # Attention split over tp 2 (sequence parallel), the experts whole on both ranks, which
    # route the same tokens: one data-parallel rank, so 2 micro-batches of 4.
    "fsdp-tp2": ["parallel.strategy=fsdp", "parallel.tp=2", "train.grad_accum=2"],
}


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_experts_at_world_2_equal_one_process(one_process, small_dataset, tmp_path, layout):
    run = tmp_path / layout
    overrides = [*base_overrides(small_dataset, run, steps=STEPS), "model.preset=tiny-moe", "train.micro_batch=4"]
    check(train([*overrides, *LAYOUTS[layout], *eval_overrides(small_dataset)], nproc=2))
    # The standing tolerances (helpers/numerics.py), final weights included: summation order only,
    # as each token meets the same experts in the same order among their slots, on
    # whichever rank they sit.
    assert_same_training(run, one_process, steps=STEPS)
    _routing_counted_once(run)


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(400)
def test_tensor_parallel_beside_expert_parallel_equals_one_process(one_process, small_dataset, tmp_path):
    """tp 2 x dp 2 at world 4 (tp innermost), the experts split over the two data-parallel
    ranks of each tp coordinate (ep 2): attention split over tp; both ranks of a tp group
    route the group's whole micro-batch (models/llama_tp.py), each in its own ep group, to
    the rank holding each expert: the same work twice, the gradients those of one process."""
    run = tmp_path / "tp2-ep2"
    overrides = [*base_overrides(small_dataset, run, steps=STEPS), "model.preset=tiny-moe", "train.micro_batch=4"]
    layout = ["parallel.strategy=fsdp", "parallel.tp=2", "parallel.ep=2"]
    check(train([*overrides, *layout, *eval_overrides(small_dataset)], nproc=4))
    assert_same_training(run, one_process, steps=STEPS)
    _routing_counted_once(run)  # from one rank of each tp group: 2 data-parallel ranks' tokens


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(400)
def test_hybrid_sharding_beside_expert_parallel_equals_one_process(one_process, small_dataset, tmp_path):
    """dp_replicate 2 x dp_shard 2 at world 4, ep 2 within each replica: the experts' FSDP
    group (dp_replicate, dp_shard_mod_ep) replicates each rank's 4 experts over the replicas,
    their gradients summed over all four ranks' tokens and divided by dp = 4. (At world 8,
    dp_shard_mod_ep 2, checked by hand: docs/moe.md.)"""
    run = tmp_path / "hsdp-ep2"
    overrides = [*base_overrides(small_dataset, run, steps=STEPS), "model.preset=tiny-moe", "train.micro_batch=2"]
    layout = ["parallel.strategy=fsdp", "parallel.dp_replicate=2", "parallel.ep=2"]
    check(train([*overrides, *layout, *eval_overrides(small_dataset)], nproc=4))
    assert_same_training(run, one_process, steps=STEPS)


def _routing_counted_once(run) -> None:
    """Every engine reports the routing (found through its wrappers: DDP, FSDP, DeepSpeed's
    engine): each interval's loads count top_k slots per token of every data-parallel rank
    (two, 4 sequences each), of training steps only (the evaluations' forwards route too,
    and are not counted)."""
    intervals = [r for r in read_metrics(run / "metrics.jsonl", events=True) if r.get("event") == "interval"]
    assert intervals and all(sum(layer["load"]) == 2 * r["moe"]["tokens"] for r in intervals for layer in r["moe"]["layers"])
    assert sum(r["moe"]["tokens"] for r in intervals) == STEPS * 2 * 4 * 64  # ranks x micro-batch x seq_len


@pytest.fixture(scope="module")
def untied_one_process(small_dataset, tmp_path_factory):
    """As one_process with untied embeddings, which a pipeline needs (its first stage holds
    the embedding, its last the head)."""
    run = tmp_path_factory.mktemp("moe-untied-ref") / "w1"
    overrides = [*base_overrides(small_dataset, run, steps=STEPS), "model.preset=tiny-moe", "model.tie_embeddings=false"]
    check(train([*overrides, "train.micro_batch=8", "checkpoint.every=4", *eval_overrides(small_dataset)]))
    return run


PIPELINES = {
    # Two stages of two blocks, one per rank; the step's 8 sequences as 2 micro-batches of 4.
    "pp2": (2, ["parallel.pp_schedule=1f1b", "train.micro_batch=4", "train.grad_accum=2"]),
    # pp 2 x dp 2: four stages of one block, two on each rank (interleaved), and within each
    # stage the experts split over its two data-parallel ranks (ep 2): 2 x 2 x 2 sequences.
    "pp2-ep2": (4, ["parallel.pp_schedule=interleaved_1f1b", "parallel.ep=2", "train.micro_batch=2", "train.grad_accum=2"]),
}


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", list(PIPELINES))
def test_experts_in_a_pipeline_equal_one_process(untied_one_process, small_dataset, tmp_path, layout):
    nproc, args = PIPELINES[layout]
    run = tmp_path / layout
    overrides = [*base_overrides(small_dataset, run, steps=STEPS), "model.preset=tiny-moe", "model.tie_embeddings=false"]
    check(train([*overrides, "parallel.strategy=fsdp", "parallel.pp=2", *args, *eval_overrides(small_dataset)], nproc=nproc))
    # The standing tolerances: summation order only. Each block's auxiliary loss reaches
    # the last stage's loss beside the hidden states (models/llama.py), so its gradient
    # reaches the routers of every stage: a stage's dropped would move the weights.
    assert_same_training(run, untied_one_process, steps=STEPS)
    # Every MoE layer's load is reported once, from the stage that holds it, with what one
    # process counts: each stage's rows of the whole table, summed over the ranks. As
    # test_moe_telemetry's expert-parallel comparison: the same routing up to a near tie
    # decided the other way (1% of the slots), the auxiliary loss per forward to 1e-3.
    intervals = [r for r in read_metrics(run / "metrics.jsonl", events=True) if r.get("event") == "interval"]
    want = [r for r in read_metrics(untied_one_process / "metrics.jsonl", events=True) if r.get("event") == "interval"]
    for got, ref in zip(intervals, want, strict=True):
        assert got["moe"]["tokens"] == ref["moe"]["tokens"]
        assert got["moe"]["aux"] == pytest.approx(ref["moe"]["aux"], rel=1e-3)
        for a, b in zip(got["moe"]["layers"], ref["moe"]["layers"], strict=True):
            assert max(abs(x - y) for x, y in zip(a["load"], b["load"])) <= 0.01 * sum(b["load"])
            assert a["aux"] == pytest.approx(b["aux"], rel=1e-3)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_capacity_trains_planned_and_counts_what_it_dropped(small_dataset, tmp_path):
    # The planner traces the block on fake tensors (balanced routing, each expert's first
    # slots kept), then the run drops the slots past each expert's capacity and says how many.
    run = tmp_path / "capacity"
    check(train([*base_overrides(small_dataset, run, steps=5), "model.preset=tiny-moe", "model.moe.capacity_factor=1.0"]))
    (interval,) = [r for r in read_metrics(run / "metrics.jsonl", events=True) if r.get("event") == "interval"]
    layers = interval["moe"]["layers"]
    assert len(layers) == 4 and all(layer["dropped"] > 0 for layer in layers), layers
    # The loads count the routing's decisions, before the drop: top_k slots per token.
    assert all(sum(layer["load"]) == interval["moe"]["tokens"] * 2 for layer in layers)


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("balance", ["aux", "sequence_aux"])
def test_a_micro_batch_the_run_chose_is_said_where_the_balance_follows_it(small_dataset, tmp_path, balance):
    # Only the per-micro-batch balance makes the numbers depend on the micro-batch: a plan
    # choosing it (train.micro_batch=auto) says so in one line, and says nothing otherwise.
    run = tmp_path / balance
    overrides = [*base_overrides(small_dataset, run, steps=1), "model.preset=tiny-moe", f"model.moe.balance={balance}"]
    out = check(train([*overrides, "train.micro_batch=auto", "train.global_batch=8"])).stdout
    said = [line for line in out.splitlines() if "model.moe.balance=aux counts" in line]
    if balance == "aux":
        assert len(said) == 1 and "the plan chose it, configured: auto" in said[0], out
        assert "model.moe.balance=sequence_aux keeps them to the global batch" in said[0]
    else:
        assert not said, said
    # The loss rows are the cross entropy; the routers' terms are in the interval rows, apart.
    (interval,) = [r for r in read_metrics(run / "metrics.jsonl", events=True) if r.get("event") == "interval"]
    layers = interval["moe"]["layers"]
    assert interval["moe"]["aux"] == pytest.approx(sum(layer["aux"] for layer in layers), rel=1e-5)
    assert all(layer["balance"] >= 1.0 - 1e-6 and layer["z"] > 0 for layer in layers), layers  # balanced: exactly 1
