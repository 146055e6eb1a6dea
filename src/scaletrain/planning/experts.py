"""What a mixture of experts, and expert parallelism (`parallel.ep`), change in a plan.

A token passes through top_k of each MoE layer's E experts: FLOPs per token, hence the
compute time and MFU, count those (ModelSpec.flops_per_token); memory holds all of them.

Expert parallel (engines/expert_parallel.py, fsdp only) splits each MoE layer's experts over
ep of the shard ranks (E/ep each, ep innermost: neighbouring ranks); FSDP shards those over
the shard/ep ranks holding the same experts, everything else over all shard ranks. So:
  - model states per rank do not change: expert weights / ep / (shard / ep) = / shard;
  - FSDP's gathered block holds E/ep of its experts, not E (smaller gathered buffers);
  - the experts' all-gathers and reduce-scatters move E/ep experts over shard/ep ranks,
    (shard/ep - 1)/(shard/ep) x expert weights / ep per rank: about ep times fewer bytes;
  - the routed token slots travel by all-to-all: per MoE layer and micro-batch, dispatch and
    combine in forward, the same two reversed in backward (and forward's two again when
    activation checkpointing recomputes it), top_k x tokens x dim x bytes each, of which
    (ep-1)/ep leave the rank. Nothing hides them (the experts wait for their tokens, the
    block for the experts' outputs): exposed, plus a start-up per exchange and for the
    exchange of slot counts before each dispatch (models/moe.py);
  - a group limit (model.moe.groups, topk_groups) does not change those bytes: each slot
    travels on its own (no copy of a token per node forwarded inside it, as DeepEP's
    dispatch does), and balanced routing sends every rank the same share of the slots
    either way; what the limit bounds is how many ranks' groups one token visits;
  - activations: the traced MoE block (balanced routing, planning/activations.py). Balanced,
    a rank's experts receive as many slots as its own tokens make (top_k x tokens), so the
    trace holds under ep; an imbalanced router gives the busiest rank more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from scaletrain.errors import UserError
from scaletrain.models.capabilities import ExpertSplit, capability
from scaletrain.models.spec import LlamaSpec, ModelSpec
from scaletrain.planning.hardware import Device
from scaletrain.planning.pipeline import rank_share
from scaletrain.planning.setup import Setup
from scaletrain.strategies import TABLE


@dataclass(frozen=True)
class Experts:
    experts: int  # routed experts per MoE layer (E)
    top_k: int
    layers: int  # MoE layers
    per_layer: int  # weights of one MoE layer's routed experts, all E (shared experts are dense)
    # Of the top_k x tokens slots, those an expert takes: balanced, all of them unless the
    # capacity factor is below 1 (models/moe.py drops the slots past it before they travel).
    kept: float = 1.0

    @property
    def total(self) -> int:
        return self.layers * self.per_layer


def whole_under_tp(model: ModelSpec) -> float:
    """The share of the parameters tensor parallel leaves whole on every tp rank: each MoE
    layer's router, routed and shared experts (models/llama_tp.py keeps a mixture of
    experts out of the split); 0 for a dense model."""
    if not isinstance(model, LlamaSpec) or not model.shape.experts:
        return 0.0
    s = model.shape
    per_layer = s.dim * s.experts + 3 * s.dim * s.expert_ffn_dim * (s.experts + s.shared_experts)
    return s.moe_layers * per_layer / model.counts().total


def tp_split(model: ModelSpec, s: Setup) -> float:
    """The share of its data-parallel shard of the states one tp rank holds: 1/tp of what
    tensor parallel splits, all of what it leaves whole (whole_under_tp)."""
    if s.tp == 1:
        return 1.0
    whole = whole_under_tp(model)
    return (1 - whole) / s.tp + whole


def repeated_under_tp(model: ModelSpec) -> float:
    """Training FLOPs per token that every tp rank computes for its whole tp group's tokens
    (models/llama_tp.py gathers the sequence before a MoE layer and runs it whole on each
    rank): each MoE layer's router, shared experts and the top_k routed experts a token
    passes through, x6 (forward and backward), as ModelSpec.flops_per_token counts them; 0
    for a dense model."""
    if not isinstance(model, LlamaSpec) or not model.shape.experts:
        return 0.0
    s = model.shape
    per_layer = s.dim * s.experts + 3 * s.dim * s.expert_ffn_dim * s.shared_experts
    return 6.0 * (s.moe_layers * per_layer + model.active_expert_params())


def moe_layers_held(model: ModelSpec, s: Setup) -> tuple[int, int]:
    """(fewest, most) MoE layers on the rank the planner sizes: every one without a pipeline;
    with one, the blocks of the rank holding the most parameters (pipeline.rank_share), as
    many of which may be dense as the model has dense blocks. The fewest bound what ep saves
    that rank (conservative for memory and gathers), the most what it sends by all-to-all."""
    e = experts_of(model)
    if e is None:
        return 0, 0
    if s.pp == 1:
        return e.layers, e.layers
    blocks = rank_share(model, s.pp, s.pp_schedule, s.seq_len)[1]
    return max(0, blocks - (model.n_blocks - e.layers)), min(e.layers, blocks)


def experts_of(model: ModelSpec) -> Experts | None:
    """The routed experts of a mixture of experts; None for a dense model: the built-in
    decoder's from its shape, a Hugging Face model's from its config (`routed_experts`) and
    its stacked expert weights (ModelCounts.experts); the ModelSpec protocol carries none."""
    if not isinstance(model, LlamaSpec):
        counts, routed = model.counts(), getattr(model, "routed_experts", None)
        if routed is None or not counts.experts or not counts.expert_layers:
            return None
        experts, top_k = routed()
        return Experts(experts, top_k, counts.expert_layers, counts.experts // counts.expert_layers) if experts else None
    if not model.shape.experts:
        return None
    s = model.shape
    kept = min(1.0, s.capacity_factor) if s.capacity_factor else 1.0
    return Experts(s.experts, s.top_k, s.moe_layers, 3 * s.dim * s.expert_ffn_dim * s.experts, kept)


def moe_summary(model: ModelSpec, seq_len: int) -> dict[str, Any]:
    """A mixture of experts' totals for the plan's JSON ({} for a dense model)."""
    e = experts_of(model)
    if e is None:
        return {}
    total = model.counts().total
    # A Hugging Face model's: the routed experts' top_k of E (its shared experts are dense).
    active = model.active_params() if isinstance(model, LlamaSpec) else total - e.total + e.total * e.top_k // e.experts
    return {
        "params": total,
        "active_params": active,
        "expert_params": e.total,
        "experts": e.experts,
        "top_k": e.top_k,
        "moe_layers": e.layers,
        "flops_per_token": model.flops_per_token(seq_len),
    }


def moe_note(model: ModelSpec, seq_len: int) -> list[str]:
    summary = moe_summary(model, seq_len)
    if not summary:
        return []
    total, active, fpt = summary["params"], summary["active_params"], summary["flops_per_token"]
    every = fpt + 6 * (total - active)  # as if each token went through every expert
    return [
        f"a mixture of experts: {total / 1e9:.3g}B parameters, {active / 1e9:.3g}B active per token (top-{summary['top_k']} "
        f"of {summary['experts']} experts in {summary['moe_layers']} layers): compute time and MFU count the active ones, "
        f"{fpt / 1e9:.3g} GFLOPs per token ({every / 1e9:.3g} if every expert counted, {every / fpt:.1f}x); memory holds "
        "all of them; routing taken as balanced (the busiest expert's share sets the real peak and all-to-all time)"
    ]


def ep_sizes(model: ModelSpec, shard: int, cp: int = 1) -> list[int]:
    """The ep degrees a layout can take: > 1, dividing the shard group (dp_shard x cp) and the
    experts; under cp a multiple of it (the ep group holds whole cp groups: config/parallel.py)."""
    e = experts_of(model)
    if e is None:
        return []
    sizes = [ep for ep in range(2, min(shard, e.experts) + 1) if shard % ep == 0 and e.experts % ep == 0 and ep % cp == 0]
    return [ep for ep in sizes if _splits(model, ep)]


def _splits(model: ModelSpec, ep: int) -> bool:
    """Whether the model's spec takes `ep` (a Hugging Face model whose experts transformers
    does not stack does not)."""
    try:
        capability(model, ExpertSplit, f"parallel.ep={ep}", "parallel.ep=1").check_ep(ep)  # experts_of found experts
    except UserError:
        return False
    return True


def ep_options(options: list[Setup], model: ModelSpec) -> list[Setup]:
    """Each option a strategy with expert parallel can take with it (plain or hybrid
    sharding, and any offload config/schema.py takes with ep), at every ep size: under a
    pipeline over each stage's data-parallel ranks, under tp over those of each tp
    coordinate, under hybrid sharding within each replica."""
    out = []
    for o in options:
        if TABLE[o.strategy].ep:
            out += [replace(o, ep=ep) for ep in ep_sizes(model, o.shard, o.cp)]
    return out


def ungathered(model: ModelSpec, s: Setup) -> tuple[int, int]:
    """(per MoE block, in all) expert weights FSDP does not gather on a rank under ep: the
    other ranks' experts, (ep-1)/ep of them (0 without ep)."""
    e = experts_of(model)
    if e is None or s.ep == 1:
        return 0, 0
    per_block = e.per_layer - e.per_layer // s.ep
    return per_block, moe_layers_held(model, s)[0] * per_block


def sharded_traffic(
    model: ModelSpec, s: Setup, psi: float, share: float, gathers: int, param_bytes: int, grad_bytes: int
) -> float:
    """FSDP's ring gathers and gradient reduce-scatters per rank under ep: the dense part
    over all shard ranks, the rank's E/ep experts over the shard/ep ranks holding them."""
    e = experts_of(model)
    assert e is not None and s.ep > 1
    per_param = gathers * param_bytes + share * grad_bytes
    m = s.shard // s.ep
    held = moe_layers_held(model, s)[0] * e.per_layer  # this (pipeline) rank's MoE layers' experts
    return (s.shard - 1) / s.shard * (psi - held) * per_param + (m - 1) / m * held / s.ep * per_param


def a2a_bytes_per_step(model: ModelSpec, s: Setup) -> float:
    """Bytes each rank sends by all-to-all per step: 4 exchanges per MoE layer and
    micro-batch (6 with activation checkpointing) of top_k x tokens x dim (the kept slots
    under a capacity factor below 1), (ep-1)/ep of each leaving the rank."""
    e = experts_of(model)
    if e is None or s.ep == 1:
        return 0.0
    act_bytes = 4 if s.precision == "fp32" else 2
    exchange = e.kept * e.top_k * s.micro_batch * s.local_seq_len * model.hidden_size * act_bytes  # this rank's tokens
    exchanges = 6 if s.activation_checkpointing else 4
    return moe_layers_held(model, s)[1] * s.grad_accum * exchanges * exchange * (s.ep - 1) / s.ep


def a2a_collectives(model: ModelSpec, s: Setup) -> int:
    """All-to-alls per step: per MoE layer and micro-batch the slot counts, dispatch and
    combine in forward, two in backward, three more when the forward is recomputed."""
    e = experts_of(model)
    if e is None or s.ep == 1:
        return 0
    return moe_layers_held(model, s)[1] * s.grad_accum * (8 if s.activation_checkpointing else 5)


def off_node_share(ep: int, per_node: int) -> float:
    """The share of a rank's token slots (1/ep to each rank of its ep group, itself included)
    bound for another node, for the worst-placed rank: an ep group is ep consecutive ranks."""
    worst = 0
    for r in range(math.lcm(ep, per_node)):
        first = r // ep * ep
        worst = max(worst, sum(1 for q in range(first, first + ep) if q // per_node != r // per_node))
    return worst / ep


def a2a_seconds(model: ModelSpec, s: Setup, device: Device, per_node: int) -> float:
    """The all-to-alls' time per step, all of it exposed: NVLink carries the slots for ranks
    of the same node and the network the others', both at once (NCCL sends to every peer
    together), so the slower of the two; plus each exchange's start-up."""
    sent = a2a_bytes_per_step(model, s)
    if not sent:
        return 0.0
    slots = sent * s.ep / (s.ep - 1)  # every slot, the rank's own included
    off = off_node_share(s.ep, per_node)
    on = (s.ep - 1) / s.ep - off
    links = max(slots * on / device.intra_node_bw, slots * off / device.inter_node_bw)
    return links + a2a_collectives(model, s) * device.collective_latency
