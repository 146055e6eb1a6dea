"""The planner for a mixture of experts: total and active parameters, FLOPs (and so compute
time) from the active ones, expert parallel's memory and traffic terms against hand
computations, `strategy: auto` weighing ep (Mixtral-8x7B on nodes of 8 x 80 GiB) and the
run taking its choice, dense plans as they were, and (dist) tiny-moe measured at ep 2."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import yaml

from scaletrain.config import Config, load_config
from scaletrain.config.parallel import dims_for
from scaletrain.launch.distributed import World
from scaletrain.planning import make_plan, planning_spec
from scaletrain.planning.clock.compute import micro_batch
from scaletrain.planning.clock.rates import rates_for
from scaletrain.planning.clock.trace import block_work
from scaletrain.planning.experts import (
    Experts,
    a2a_bytes_per_step,
    a2a_seconds,
    ep_sizes,
    experts_of,
    moe_summary,
    off_node_share,
)
from scaletrain.planning.hardware import gpu
from scaletrain.planning.memory import estimate
from scaletrain.planning.planner import comm_bytes_per_step, evaluate
from scaletrain.planning.setup import Setup

from helpers.launch import check, run, torchrun

H100 = gpu("h100", "80GiB")
MIXTRAL = ["model.preset=mixtral-8x7b", "data.seq_len=4096", "precision=bf16"]

# Mixtral-8x7B by hand: width, layers, heads (kv heads), head width, expert width, experts, top-k, vocabulary.
D, L, H, KV, HD, F, E, K, V = 4096, 32, 32, 8, 128, 14336, 8, 2, 32000
ATTENTION = 2 * D * D + 2 * D * KV * HD  # wq, wo; wk, wv (grouped-query)
ROUTER = D * E
EXPERTS = E * 3 * D * F  # one MoE layer's routed experts: w1, w3 [E, D, F], w2 [E, F, D]
BLOCK = ATTENTION + ROUTER + EXPERTS + 2 * D  # + two RMSNorm weights
ROOT = 2 * V * D + D  # untied embedding and head, final norm
TOTAL = ROOT + L * BLOCK
ACTIVE = TOTAL - L * (E - K) * 3 * D * F


def config(*extra: str) -> Config:
    return load_config([], [*MIXTRAL, *extra])


def mixtral():
    return planning_spec(config())


@pytest.mark.unit
def test_mixtral_counts_all_parameters_and_its_flops_count_the_active_ones():
    spec = mixtral()
    assert spec.counts().total == TOTAL == 46_702_792_704  # Mixtral's published 46.7B
    assert spec.active_params() == ACTIVE == 12_879_925_248  # and 12.9B active per token
    # 6 x the weights a token is multiplied by (attention, router, head, top_k experts per
    # layer), plus attention's scores and weighted sum: 12 x layers x heads x head width x T.
    fpt = 6 * (L * (ATTENTION + ROUTER) + V * D + L * K * 3 * D * F) + 12 * L * H * HD * 4096
    assert spec.flops_per_token(4096) == fpt
    assert moe_summary(spec, 4096) == {
        "params": TOTAL,
        "active_params": ACTIVE,
        "expert_params": L * EXPERTS,
        "experts": E,
        "top_k": K,
        "moe_layers": L,
        "flops_per_token": fpt,
    }
    # The step's compute follows the experts a token passes through: the traced MoE block's
    # matmuls are the router's, the attention's and top_k experts' (balanced routing), and an
    # ep layout's step shows its all-to-all as exposed communication, its gathers hidden.
    s = Setup("fsdp", 64, 1, 4096, "bf16", grad_accum=16, ep=8)
    c = evaluate(spec, s, config(), H100, 8, H100.memory, None)
    block = block_work(spec, 1, 4096, "pure16")
    matmul = sum(x.flops * x.count for x in block.forward.of("matmul"))
    assert matmul == pytest.approx(2 * 4096 * (ATTENTION + ROUTER + K * 3 * D * F), rel=1e-9)
    assert c.time is not None and c.step_time == pytest.approx(c.time.total)
    (a2a,) = [t for label, t in c.time.largest["comm"] if label.startswith("expert parallel's")]
    # At one sequence of 4096 tokens a block computes for less time than its gather over the
    # network takes: part of the gathers shows too.
    (gathers,) = [t for label, t in c.time.largest["comm"] if label.startswith("FSDP's all-gathers")]
    assert a2a > 0 and gathers > 0 and c.time.phases["comm"] >= a2a + gathers
    assert not moe_summary(planning_spec(load_config([], ["model.preset=7b"])), 4096)  # dense: none


@pytest.mark.unit
def test_tp_leaves_the_mixture_of_experts_whole_in_the_plan():
    """models/llama_tp.py splits attention, not a mixture of experts: the states per rank
    divide by tp all but the MoE layers' router and experts (Mixtral by hand above)."""
    from scaletrain.planning.experts import whole_under_tp

    spec = mixtral()
    whole = L * (ROUTER + EXPERTS) / TOTAL
    assert whole_under_tp(spec) == pytest.approx(whole, rel=1e-12) and 0.9 < whole < 1
    assert whole_under_tp(planning_spec(load_config([], ["model.preset=7b"]))) == 0.0
    base = Setup.from_config(config("parallel.strategy=fsdp"), dims_for(config("parallel.strategy=fsdp").parallel, 8))
    one, two = estimate(spec, base), estimate(spec, replace(base, tp=2, dp=base.dp // 2))
    assert two.params == pytest.approx(one.params * 2 * ((1 - whole) / 2 + whole), rel=1e-9)  # dp halves, tp
    # And the built-in model's own modules say the same: the MoE feed-forwards' parameters.
    tiny = planning_spec(load_config([], ["model.preset=tiny-moe", "model.moe.shared_experts=1"]))
    with torch.device("meta"):
        model = tiny.build_meta(64)
    moe = sum(p.numel() for name, p in model.named_parameters() if ".feed_forward." in name)
    assert whole_under_tp(tiny) == pytest.approx(moe / sum(p.numel() for p in model.parameters()), rel=1e-12)


@pytest.mark.unit
def test_ep_shrinks_fsdps_gathered_experts_and_leaves_the_sharded_states_alone():
    spec = mixtral()
    base = Setup("fsdp", 64, 1, 4096, "bf16")
    one, ep8 = estimate(spec, base), estimate(spec, replace(base, ep=8))
    # Expert weights / ep / (shard / ep) = / shard: the same states per rank either way.
    assert (
        (ep8.params, ep8.grads, ep8.optimizer)
        == (one.params, one.grads, one.optimizer)
        == (4 * TOTAL / 64,) * 2 + (8 * TOTAL / 64,)
    )
    # Balanced routing: a rank's experts get as many token slots as its own tokens make.
    assert (ep8.activations, ep8.loss) == (one.activations, one.loss)
    # FSDP holds the root unit and two blocks gathered in bf16; under ep a block's gathered
    # experts are this rank's 8 / 8 = 1 of them.
    assert one.buffers == (ROOT + 2 * BLOCK) * 2
    assert ep8.buffers == (ROOT + 2 * (BLOCK - EXPERTS + EXPERTS // 8)) * 2
    assert one.peak - ep8.peak == pytest.approx(2 * EXPERTS * 7 / 8 * 2)
    ep2 = estimate(spec, replace(base, ep=2))
    assert ep2.buffers == (ROOT + 2 * (BLOCK - EXPERTS // 2)) * 2
    # Kept gathered (shard-grad-op): every unit, each MoE layer with its E/ep experts only.
    kept = estimate(spec, replace(base, ep=8, reshard_after_forward=False))
    assert kept.buffers == (TOTAL - L * EXPERTS * 7 // 8) * 2


@pytest.mark.unit
def test_ep_traffic_gathers_fewer_experts_over_fewer_ranks_and_adds_the_all_to_all():
    spec = mixtral()
    s = Setup("fsdp", 64, 1, 4096, "bf16", grad_accum=16, ep=8)
    # bf16 weights gathered in forward and backward of each of 16 micro-batches, fp32
    # gradients reduce-scattered once: ring shares of (n-1)/n.
    per_param = 16 * 2 * 2 + 4
    dense = TOTAL - L * EXPERTS
    by_hand = 63 / 64 * dense * per_param + 7 / 8 * (L * EXPERTS / 8) * per_param  # experts over 64 / 8 = 8 ranks
    assert comm_bytes_per_step(spec, s, 16) == pytest.approx(by_hand, rel=1e-12)
    assert comm_bytes_per_step(spec, replace(s, ep=1), 16) == pytest.approx(63 / 64 * TOTAL * per_param, rel=1e-12)
    # ep = shard: every rank holds whole experts, nobody gathers them.
    whole = Setup("fsdp", 8, 1, 4096, "bf16", grad_accum=16, ep=8)
    assert comm_bytes_per_step(spec, whole, 16) == pytest.approx(7 / 8 * dense * per_param, rel=1e-12)
    # Hybrid sharding (2 replicas of 32): ep inside each replica, then every rank's gradient
    # shard (TOTAL / 32 either way: dense / 32, experts / 8 / 4) all-reduced across the two.
    hybrid = replace(s, dp_replicate=2)
    replicas = 31 / 32 * dense * per_param + 3 / 4 * (L * EXPERTS / 8) * per_param + 2 * (1 / 2) * TOTAL / 32 * 4
    assert comm_bytes_per_step(spec, hybrid, 16) == pytest.approx(replicas, rel=1e-12)
    # The routed tokens: dispatch and combine, forward and backward, per MoE layer and
    # micro-batch, top_k x tokens x width x 2 bytes each, 7/8 of it to other ranks.
    exchange = K * 4096 * D * 2
    assert a2a_bytes_per_step(spec, s) == pytest.approx(L * 16 * 4 * exchange * 7 / 8, rel=1e-12)
    # Activation checkpointing runs the forward's two again.
    assert a2a_bytes_per_step(spec, replace(s, activation_checkpointing=True)) == pytest.approx(
        L * 16 * 6 * exchange * 7 / 8, rel=1e-12
    )
    assert a2a_bytes_per_step(spec, replace(s, ep=2)) == pytest.approx(L * 16 * 4 * exchange / 2, rel=1e-12)
    assert a2a_bytes_per_step(spec, replace(s, ep=1)) == 0
    # Under cp each rank routes its seq_len / cp tokens of each sequence.
    assert a2a_bytes_per_step(spec, replace(s, cp=2, ep=2)) == pytest.approx(L * 16 * 4 * exchange / 2 / 2, rel=1e-12)
    # A capacity factor below 1 drops the slots past it before they travel; above 1 (balanced) none.
    for factor, kept in ((0.5, 0.5), (1.25, 1.0)):
        capped = planning_spec(config(f"model.moe.capacity_factor={factor}"))
        assert a2a_bytes_per_step(capped, s) == pytest.approx(kept * L * 16 * 4 * exchange * 7 / 8, rel=1e-12)
    c = evaluate(spec, s, config(), H100, 8, H100.memory, None)
    assert c.ep_comm_bytes == a2a_bytes_per_step(spec, s)
    assert c.comm_bytes == pytest.approx(by_hand + c.ep_comm_bytes, rel=1e-12) and c.dp_bytes == pytest.approx(by_hand)


@pytest.mark.unit
def test_all_to_all_time_takes_nvlink_inside_a_node_and_the_network_across():
    assert off_node_share(8, 8) == off_node_share(2, 8) == 0.0
    assert off_node_share(16, 8) == 0.5  # half of an ep-16 group sits on the other node
    assert off_node_share(4, 6) == 0.5  # groups 4-7 straddle nodes 0-5 and 6-11: ranks 4, 5 send half away
    spec = mixtral()
    s = Setup("fsdp", 64, 1, 4096, "bf16", grad_accum=16, ep=8)
    sent = a2a_bytes_per_step(spec, s)
    starts = L * 16 * 5 * 20e-6  # counts, dispatch, combine forward; two backward
    assert a2a_seconds(spec, s, H100, 8) == pytest.approx(sent / 450e9 + starts, rel=1e-12)
    # DeepSeekMoE's 64 experts at ep 16 over nodes of 8: 7/16 of the slots over NVLink, 8/16
    # over the network at the same time; the network's share is the slower.
    deepseek = planning_spec(load_config([], ["model.preset=deepseek-moe-16b", "data.seq_len=4096", "precision=bf16"]))
    d = Setup("fsdp", 64, 1, 4096, "bf16", grad_accum=4, ep=16)
    slots = 27 * 4 * 4 * (6 * 4096 * 2048 * 2)  # 27 MoE layers (the first is dense), top-6
    assert a2a_bytes_per_step(deepseek, d) == pytest.approx(slots * 15 / 16, rel=1e-12)
    assert a2a_seconds(deepseek, d, H100, 8) == pytest.approx(slots * 8 / 16 / 50e9 + 27 * 4 * 5 * 20e-6, rel=1e-12)


@pytest.mark.unit
def test_ep_sizes_divide_the_shard_group_and_the_experts():
    assert ep_sizes(mixtral(), 64) == [2, 4, 8]
    assert ep_sizes(mixtral(), 12) == [2, 4]
    deepseek = planning_spec(load_config([], ["model.preset=deepseek-moe-16b"]))
    assert ep_sizes(deepseek, 64) == [2, 4, 8, 16, 32, 64]
    assert ep_sizes(planning_spec(load_config([], ["model.preset=8b"])), 64) == []
    # Under cp the ep group holds whole cp groups (config/parallel.py): multiples of cp only.
    assert ep_sizes(mixtral(), 16, cp=2) == [2, 4, 8] and ep_sizes(mixtral(), 16, cp=4) == [4, 8]
    # 3 ranks and 8 experts: no ep to weigh, and the plan says why.
    plan = make_plan(config("train.micro_batch=1"), mixtral(), 3, 1, gpu("h200", "1TiB"))
    assert "expert parallel not weighed: no ep > 1 divides both the data-parallel size (3) and the 8 experts" in plan.reasons


@pytest.mark.unit
def test_a_hugging_face_qwen3_moe_is_planned_as_the_preset_of_the_same_shape():
    # Its experts from the config (num_experts, num_experts_per_tok) and its stacked weights
    # (ModelCounts.experts over the blocks holding them): the same experts, totals, active
    # parameters and FLOPs as the built-in qwen3-moe-30b-a3b, so ep is weighed for it alike.
    hf = {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
          "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
          "head_dim": 128, "vocab_size": 151936, "intermediate_size": 6144}  # fmt: skip
    theirs = planning_spec(load_config([], ["model.source=hf", f"model.hf_config={json.dumps(hf)}"]))
    ours = planning_spec(load_config([], ["model.preset=qwen3-moe-30b-a3b"]))
    assert experts_of(theirs) == experts_of(ours) == Experts(128, 8, 48, 3 * 2048 * 768 * 128)
    assert moe_summary(theirs, 4096) == moe_summary(ours, 4096)
    assert moe_summary(theirs, 4096)["active_params"] == 3_353_032_704  # published: 3.3B activated
    assert ep_sizes(theirs, 16) == [2, 4, 8, 16]


@pytest.mark.unit
def test_auto_plans_mixtral_on_8_nodes_of_8_x_80gib_with_ep_8_and_says_why():
    plan = make_plan(config(), mixtral(), 64, 8, H100)
    s = plan.chosen.setup
    # Micro-batch 16 fits nothing; at 1 (x16 accumulated over 64 data-parallel ranks, the same
    # global batch) fsdp with ep 8: each rank gathers its one expert of each layer over the 8
    # ranks holding it, the routed tokens cross inside a node. The fastest that fits, or the
    # simplest within 2% of it (fsdp + shard-grad-op + ep 8 is within 2%).
    fastest = min(c.step_time for c in plan.candidates if c.fits)
    assert (s.strategy, s.pp, s.ep, s.micro_batch, s.grad_accum) == ("fsdp", 1, 8, 1, 16)
    assert plan.chosen.fits and plan.chosen.step_time <= fastest * 1.02
    # Why ep, against the fastest layout without it (a pipeline: each stage gathered once per
    # step), and what the same layout without ep moves.
    (why,) = [r for r in plan.reasons if r.startswith("ep=8: ")]
    best_flat = min((c for c in plan.candidates if c.fits and c.setup.ep == 1), key=lambda c: c.step_time)
    assert best_flat.setup.pp > 1 and best_flat.step_time > plan.chosen.step_time
    assert "each rank holds 1 of each MoE layer's 8 experts" in why and "over NVLink inside a node" in why
    assert f"for {best_flat.setup.label}, the fastest without expert parallel" in why
    # Without a pipeline, ep 8 gathers each rank's one expert over the 8 ranks holding it: the
    # same layout without ep gathers all experts for every micro-batch over the network.
    ep8 = next(c for c in plan.candidates if c.setup.label == "fsdp + ep 8 + micro-batch 1")
    same = evaluate(mixtral(), replace(ep8.setup, ep=1), config(), H100, 8, plan.usable, None)
    assert ep8.fits and same.fits and same.dp_bytes > 5 * ep8.dp_bytes and same.step_time > ep8.step_time
    # The layouts a mixture of experts trains with (docs/moe.md "Where it trains"): tp (its
    # experts whole on every tp rank) and pp (ep inside each stage), each with and without ep
    # over the data-parallel ranks; no tp x pp, no cp.
    kinds = {(c.setup.tp > 1, c.setup.pp > 1, c.setup.ep > 1) for c in plan.candidates}
    assert kinds == {(tp, pp, ep) for tp in (False, True) for pp in (False, True) for ep in (False, True) if not (tp and pp)}
    assert all(c.setup.cp == 1 for c in plan.candidates)
    assert {c.setup.ep for c in plan.candidates if c.setup.pp == 2} == {1, 2, 4, 8}  # the stage's 32 ranks, the 8 experts
    out = plan.as_dict()
    assert out["moe"] == {**moe_summary(mixtral(), 4096), "ep": 8}
    assert all("ep" in c and "ep_comm_bytes_per_step" in c for c in out["candidates"])
    assert any("12.9B active per token" in n for n in plan.notes)


@pytest.mark.unit
def test_qwen3_moe_on_2_nodes_of_8_x_80gib_shards_across_the_nodes_and_says_why_not_ep():
    # Issue 40's question: Qwen3-30B-A3B (128 experts, top-8) at sequence 4096 on 2 x 8 GPUs of
    # 80 GiB, in bf16 (what a run applies on such a GPU). fsdp with activation checkpointing over
    # all 16: its gathers cross between the nodes as rings over all 8 NICs of each, behind the
    # blocks' compute; a pipeline pays its bubble, expert parallel its all-to-all, all exposed.
    qwen = lambda *extra: load_config([], ["model.preset=qwen3-moe-30b-a3b", "data.seq_len=4096", *extra])  # noqa: E731
    plan = make_plan(qwen("precision=bf16"), planning_spec(qwen("precision=bf16")), 16, 2, H100)
    s = plan.chosen.setup
    assert (s.strategy, s.pp, s.ep, s.tp, s.activation_checkpointing) == ("fsdp", 1, 1, 1, True)
    # Selective checkpointing (models/selective_ac.py) fits at micro-batch 4 and repeats less than full.
    full = [c for c in plan.candidates if c.fits and c.setup == replace(s, selective=False)]
    assert s.selective and full and plan.chosen.step_time < full[0].step_time
    # A run planned so (parallel.strategy=auto) trains what was planned: the mode in its resolved config.
    from scaletrain.training.preflight import _resolved

    resolved, _ = _resolved(qwen("precision=bf16", "parallel.strategy=auto"), plan, True, False, H100, [])
    assert (resolved.parallel.activation_checkpointing, resolved.parallel.ac_mode) == (True, "selective")
    piped = min((c for c in plan.candidates if c.fits and c.setup.pp > 1), key=lambda c: c.step_time)
    with_ep = min((c for c in plan.candidates if c.fits and c.setup.ep > 1), key=lambda c: c.step_time)
    assert plan.chosen.step_time < min(piped.step_time, with_ep.step_time)
    assert piped.time.phases["bubble"] > plan.chosen.time.phases["comm"]
    (why,) = [r for r in plan.reasons if "expert parallel" in r]
    assert why.startswith(f"expert parallel not chosen: the fastest layout with it, {with_ep.setup.label}, is estimated at")
    assert "is all exposed" in why
    # In fp32 the step is compute-bound (67 TFLOP/s): the exposed all-to-all is what ep adds.
    fp32 = make_plan(qwen(), planning_spec(qwen()), 16, 2, H100)
    assert fp32.chosen.setup.ep == 1
    (why,) = [r for r in fp32.reasons if "expert parallel" in r]
    assert why.startswith("expert parallel not chosen: the fastest layout with it") and "is all exposed" in why


@pytest.mark.unit
def test_a_pipeline_rank_counts_the_moe_layers_of_its_stages():
    """Under pp each rank holds its stages' MoE layers: its all-to-all, its experts' gathers
    and the experts it leaves ungathered are those layers' (all 32 of Mixtral's blocks are
    MoE: 16 on each of 2 ranks with 1f1b); DeepSeekMoE's first block is dense, so the rank
    holding it has one MoE layer fewer (the planner sizes the fullest rank: counted both ways)."""
    from scaletrain.planning.experts import moe_layers_held
    from scaletrain.planning.memory import engine_buffers

    spec = mixtral()
    flat = Setup("fsdp", 32, 1, 4096, "bf16", grad_accum=16, ep=8)
    piped = replace(flat, pp=2, pp_schedule="1f1b", reshard_after_forward=False)
    assert moe_layers_held(spec, flat) == (32, 32) and moe_layers_held(spec, piped) == (16, 16)
    assert a2a_bytes_per_step(spec, piped) == pytest.approx(a2a_bytes_per_step(spec, flat) / 2, rel=1e-12)
    # The stage's 16 blocks gathered once per step, each with this rank's 1 of 8 experts only;
    # the last stage holds the head and the final norm too (the larger of the two by parameters).
    stage = V * D + D + 16 * BLOCK
    assert engine_buffers(spec, piped) == (stage - 16 * EXPERTS * 7 // 8) * 2
    assert engine_buffers(spec, replace(piped, ep=1)) == stage * 2
    # Its gathers and gradient reduce-scatters: the dense part over the stage's 32 ranks, its
    # experts over the 4 holding the same ones, once per step (a pipeline keeps the stage gathered).
    per_param = 2 + 4
    by_hand = 31 / 32 * (stage - 16 * EXPERTS) * per_param + 3 / 4 * 16 * EXPERTS / 8 * per_param
    assert comm_bytes_per_step(spec, piped, 16) == pytest.approx(by_hand, rel=1e-12)
    deepseek = planning_spec(load_config([], ["model.preset=deepseek-moe-16b", "data.seq_len=4096", "precision=bf16"]))
    d = Setup("fsdp", 8, 1, 4096, "bf16", grad_accum=8, pp=2, pp_schedule="1f1b", ep=2, reshard_after_forward=False)
    fewest, most = moe_layers_held(deepseek, d)
    assert most - fewest == 1 and most <= 14


@pytest.mark.unit
def test_tp_runs_the_moe_layers_whole_on_every_tp_rank_in_the_plan():
    """models/llama_tp.py gathers the sequence before a MoE layer and runs it whole on each tp
    rank: the router's, shared and active experts' FLOPs are not divided by tp, and neither are
    their states in the data-parallel traffic."""
    from scaletrain.planning.experts import repeated_under_tp, whole_under_tp

    spec = mixtral()
    assert repeated_under_tp(spec) == 6 * L * (ROUTER + K * 3 * D * F)
    assert repeated_under_tp(planning_spec(load_config([], ["model.preset=7b"]))) == 0
    s = Setup("fsdp", 32, 1, 4096, "bf16", grad_accum=16, tp=2, sequence_parallel=True)
    # Each tp rank: half the rest, all of the MoE layers' work (each micro-batch's 4096 tokens).
    moe = repeated_under_tp(spec) / spec.flops_per_token(4096)
    # The devices' work (DTensor's host, which tensor parallel adds, priced as the plain one's).
    rates = replace(rates_for(H100), host_op_tp=rates_for(H100).host_op)
    split, whole_ = (micro_batch(spec, x, rates, False).forward for x in (s, replace(s, tp=1)))
    assert 0.5 < moe < 1 and split / whole_ == pytest.approx((1 - moe) / 2 + moe, rel=0.05)
    whole = whole_under_tp(spec)
    per_param = 16 * 2 * 2 + 4
    assert comm_bytes_per_step(spec, s, 16) == pytest.approx(31 / 32 * TOTAL * ((1 - whole) / 2 + whole) * per_param, rel=1e-12)


@pytest.mark.unit
def test_on_one_node_ep_does_not_fit_and_the_plan_says_so():
    # 16 bytes x 46.7B / 8 = 87 GiB of FSDP model states per GPU: no ep layout fits 80 GiB.
    plan = make_plan(config(), mixtral(), 8, 1, H100)
    assert plan.chosen.setup.ep == 1 and plan.chosen.setup.offload_optimizer == "cpu"
    (why,) = [r for r in plan.reasons if "expert parallel" in r]
    assert why.startswith("expert parallel not chosen: no layout with it fits (the smallest, fsdp + ep")
    assert "micro-batch 1, needs" in why
    # With the parameters on the host (which fsdp takes with ep; no candidate of the plan's)
    # the same layout fits: said, with the keys that set it.
    (hint,) = [part for part in why.split("; ") if part.startswith("with the parameters on the host it fits: ")]
    assert "fsdp + params->cpu + ep " in hint and "parallel.offload_params=cpu parallel.ep=" in hint


@pytest.mark.unit
def test_the_chosen_layout_is_the_runs(monkeypatch):
    import scaletrain.training.preflight as preflight

    monkeypatch.setattr(preflight, "runtime_device", lambda world, local: H100)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = config("parallel.strategy=auto")
    resolved, lines = preflight.plan_run(cfg, World(0, 64, 0, torch.device("cpu"), "gloo"), planning_spec(cfg))
    chosen = make_plan(config(), mixtral(), 64, 8, H100).chosen.setup
    p = resolved.parallel
    assert (p.strategy, p.pp, p.ep, resolved.train.micro_batch, resolved.train.grad_accum) == (
        chosen.strategy,
        chosen.pp,
        chosen.ep,
        chosen.micro_batch,
        chosen.grad_accum,
    )
    assert f"ep={chosen.ep}: each rank holds 1 of each MoE layer's" in (p.auto_choice or "")
    assert f"auto -> {chosen.label}" in lines[0]
    # What the run writes as its config is a layout the schema and ParallelDims accept.
    again = Config.model_validate(yaml.safe_load(resolved.to_yaml()))
    assert dims_for(again.parallel, 64).pp == chosen.pp


@pytest.mark.unit
def test_dense_plans_are_as_before():
    # Recorded before the planner knew experts (the JSON of these and other dense cases was
    # compared byte for byte, docs/planner.md), again when its clock priced operations
    # (planning/clock), and when the clock priced a ring across nodes over as many NICs as
    # each node holds of its ranks (the 70b on 4 nodes then chose fsdp + AC over fsdp + tp 2 +
    # pp 4 + AC: test_plan.py), and when checkpointing's recompute stopped at the last tensor the
    # backward reads, as torch's does (its step 5.01 -> 4.79 s): a dense model gets no ep layout, no MoE keys.
    cases = {
        ("7b", 1): ("zero2 + micro-batch 2", 75956729868.0, 23584454656.0, 6.897849467253624),
        ("70b", 4): ("fsdp + AC", 51307565056.0, 546791225344.0, 4.792234920212862),
    }
    keys = {
        "strategy",
        "fits",
        "memory",
        "comm_bytes_per_step",
        "tp_comm_bytes_per_step",
        "pp_comm_bytes_per_step",
        "step_time_s",
        "why_not",
        "micro_batch",
        "grad_accum",
        "fits_with_micro_batch",
    }
    for (preset, nodes), (label, peak, comm, time) in cases.items():
        extra = ["train.micro_batch=1"] if preset == "70b" else []
        cfg = load_config([], [f"model.preset={preset}", "data.seq_len=4096", "precision=bf16", *extra])
        plan = make_plan(cfg, planning_spec(cfg), 8 * nodes, nodes, H100)
        c = plan.chosen
        assert (c.setup.label, c.memory.peak, c.comm_bytes) == (label, peak, comm)
        assert c.step_time == pytest.approx(time, rel=1e-12)
        assert all(x.setup.ep == 1 and x.ep_comm_bytes == 0 for x in plan.candidates)
        out = plan.as_dict()
        assert "moe" not in out and all(set(x) == keys for x in out["candidates"])
        assert not [r for r in plan.reasons + plan.notes if "expert" in r]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_measured_peak_of_tiny_moe_at_ep_2_and_what_ep_saves():
    # fp32 at world 2 (2-core CPU, gloo): each run ~10 s. MemTracker files FSDP's gathered
    # weights as parameters, so their measured drop from ep 1 to ep 2 is what the planner's
    # gathered-buffer term predicts (E/ep experts per gathered block: 4.5 MiB here).
    args = ["model.preset=tiny-moe", "data.seq_len=128", "train.micro_batch=8", "parallel.strategy=fsdp"]
    results = {}
    for ep in (1, 2):
        cmd = ["-m", "scaletrain", "plan", "--measure", "--json", "run.device=cpu", *args, f"parallel.ep={ep}"]
        results[ep] = json.loads(check(run(torchrun(cmd, 2), timeout=240)).stdout.strip().splitlines()[-1])
    assert results[2]["strategy"] == "fsdp + ep 2"
    for r in results.values():
        assert abs(r["predicted"]["peak"] / r["measured"]["peak"] - 1) <= 0.1
    predicted_saving = results[1]["predicted"]["buffers"] - results[2]["predicted"]["buffers"]
    measured_saving = results[1]["measured"]["params"] - results[2]["measured"]["params"]
    assert predicted_saving == pytest.approx(measured_saving, rel=0.05)
