"""A mixture-of-experts feed-forward for the built-in Llama block (Mixtral / DeepSeekMoE style).

A router (a Linear, dim -> experts) scores each token; the top_k experts of the softmax
take it, their outputs weighted by the (renormalized) router probabilities and summed.
Experts are SwiGLU networks held as three stacked weights [experts, ...] (GroupedExperts),
so one tensor per projection shards, checkpoints and exports like any other, and expert
parallelism splits them along their first dimension. Optional shared experts (DeepSeekMoE)
see every token. Routing is dropless unless a capacity factor is set; then an expert takes
at most ceil(capacity_factor x tokens x top_k / experts) token slots of a micro-batch, in
token order, and the slots past it are dropped (never computed; the token keeps its other
experts and the residual).

Two auxiliary terms keep the router healthy; the model's spec adds their gradient to the
loss's (its value stays the cross entropy) and the telemetry logs them apart:
  load balancing (Switch Transformer, Fedus et al. 2021): experts x sum_e f_e x P_e, where
      f_e is the share of token slots routed to expert e and P_e its mean router
      probability; 1 when balanced, up to `experts` when one expert takes everything.
      `model.moe.balance` says over what f and P are counted: sequence_aux (the default),
      each sequence's, and the term is the mean over the micro-batch's sequences, as
      DeepSeek-V3's sequence-wise balance loss; a mean of per-sequence terms is linear in
      the sequences, so with the engines' mean over micro-batches and ranks the step's term
      is the mean over the global batch however it is split (micro-batch, accumulation,
      ranks, out-of-memory recovery). aux: the micro-batch's, as Mixtral and torchtitan
      count it; f x P is not linear in the tokens, so its numbers follow the micro-batch.
  router z-loss (ST-MoE, Zoph et al. 2022): the mean squared logsumexp of the router
      logits, which keeps them small enough for the softmax to stay precise in bf16: a mean
      over tokens, invariant to the split either way.

Expert parallelism (`parallel.ep`, engines/expert_parallel.py) sets `ep_group`: each rank
of it holds experts/ep of the experts (a DTensor sharded on dim 0), and the routed token
slots travel to their expert's rank and back with `all_to_all_single` (torch's
autograd-aware functional collective, so the backward is the reverse exchange).

The experts run as one grouped matrix multiply per projection (`torch._grouped_mm`, its
offsets a cumulative sum on the device), or one after the other on the slots sorted by
expert (the loop, which reads the token counts on the host: one `.tolist()` per layer and
forward). `model.moe.experts_impl` chooses; auto takes the grouped kernel where torch runs
it without reading the offsets back (CUDA bf16 on compute capability 9.x/10.x, and the
CPU where a probe call succeeds), and always inside a compiled block, whose graph the
loop's `.tolist()` would break. Both compute the same products. Every size in a step is
static (dropped slots included: they stay as rows whose output is zeroed), so nothing
else is read back and a compiled block has no data-dependent shape. Under
FakeTensorMode (the planner tracing what a block keeps for backward) the loop runs with
the routing taken as balanced: the token counts per expert are data the tracer does not
have, and balanced routing is what the planner assumes.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.feed_forward import FeedForward
from scaletrain.models.grouped_mm import grouped_swiglu, uses_grouped_mm

if TYPE_CHECKING:
    from scaletrain.models.presets import ModelShape

# What each MoE layer reports per forward (MoE.forward's third output, detached, fp32):
# token slots routed to each expert (before any capacity drop), then these: the slots
# dropped, the weighted auxiliary loss, the tokens, and the two terms unweighted.
STAT_DROPPED, STAT_AUX, STAT_TOKENS, STAT_BALANCE, STAT_Z = range(5)
EXTRA_STATS = 5


class GroupedExperts(nn.Module):
    """`experts` SwiGLU networks as three stacked weights: w1 (gate) and w3 (up) [E, dim,
    hidden], w2 (down) [E, hidden, dim]. Under expert parallelism the weights are DTensors
    sharded on dim 0 and each rank runs its own experts (the local shard)."""

    def __init__(self, experts: int, dim: int, hidden: int, impl: str = "auto"):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.impl = impl  # model.moe.experts_impl: auto | grouped | loop

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, splits: list[int] | None) -> torch.Tensor:
        """SwiGLU of each (local) expert on its contiguous run of `tokens` (sorted by expert);
        `counts` [local experts] slots each, `splits` the same as a list where known. Rows
        past sum(counts) (dropped slots) come out unspecified: the caller masks them."""
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        if uses_grouped_mm(self.impl, tokens, w1):
            return grouped_swiglu(tokens, w1, w3, w2, counts)
        sizes = splits if splits is not None else counts.tolist()  # the host needs the split sizes
        rest = tokens.shape[0] - sum(sizes)
        parts = tokens.split([*sizes, rest])
        # Every expert runs, an empty one too: each weight then has a gradient on every
        # rank (zero where no token came), so sharded reductions see the same tensors everywhere.
        out = torch.cat([(F.silu(p @ w1[i]) * (p @ w3[i])) @ w2[i] for i, p in enumerate(parts[:-1])])
        return F.pad(out, (0, 0, 0, rest)) if rest else out


class MoE(nn.Module):
    def __init__(self, shape: ModelShape, row: int = 0):
        super().__init__()
        self.row = row  # its row in the model's [MoE layers, ...] tables: statistics, expert bias
        e, d, h = shape.experts, shape.dim, shape.expert_ffn_dim
        self.n_experts, self.top_k = e, shape.top_k
        self.capacity_factor, self.normalize = shape.capacity_factor, shape.normalize_top_k
        self.aux_weight, self.z_weight = shape.aux_loss_weight, shape.z_loss_weight
        self.per_sequence = shape.balance != "aux"  # bias's loss beside it is DeepSeek-V3's sequence-wise one
        self.sigmoid, self.groups, self.topk_groups = shape.score == "sigmoid", shape.groups, shape.topk_groups
        # balance=bias: [experts] fp32, added to the scores for choosing the experts only; a
        # view into ExpertBias's table, which moves it after each optimizer step. A plain
        # attribute, not a buffer: no engine casts it (DeepSpeed's bf16 would round the
        # updates away) and it is saved in trainer.json, not in the engines' state.
        self.expert_bias: torch.Tensor | None = None
        self.router = nn.Linear(d, e, bias=False)
        self.experts = GroupedExperts(e, d, h, shape.experts_impl)
        self.shared: nn.Module | None = None
        if shape.shared_experts:
            self.shared = FeedForward(d, h * shape.shared_experts)  # the dense SwiGLU, as wide as they are together
        self.ep_group: Any = None  # a ProcessGroup under expert parallelism (engines/expert_parallel.py)
        # Under context parallel (parallel.cp) the cp group, whose ranks hold the other parts
        # of this rank's sequences: the balance term counts their routing too (_balance).
        self.sequence_group: Any = None
        self.tile_tokens = 0  # train.tile_tokens (models/feed_forward.py `tile`); 0: the experts whole

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, dim] -> (output [B, T, dim], this layer's weighted auxiliary loss (fp32
        scalar), its statistics: slots per expert then EXTRA_STATS fields, detached)."""
        b, t, d = x.shape
        tokens = x.reshape(-1, d)
        n, k, e = tokens.shape[0], self.top_k, self.n_experts
        logits = self.router(tokens).float()  # routing in fp32: close scores decide the experts
        probs, weights, chosen = self._route(logits)  # [n, e]; [n, k] each
        routed, splits = _counts(chosen.reshape(-1), e, n * k, x)
        dropped = torch.zeros((), device=x.device)
        if self.tile_tokens and torch.is_grad_enabled() and t > self.tile_tokens:
            # train.tile_tokens: the routed experts over tiles of positions, each under its
            # own non-reentrant checkpoint (as the dense feed-forward, models/feed_forward.py):
            # the slots and the experts' hidden activations exist for one tile at a time, in
            # the forward and again in the backward. The routing above stays whole (a
            # token's experts depend on its own scores only; the balance terms count every
            # token). No capacity (refused: it counts the micro-batch's slots in token order).
            from torch.utils.checkpoint import checkpoint

            tiles = []
            for start in range(0, t, self.tile_tokens):
                part = slice(start, start + self.tile_tokens)  # views: the checkpoint keeps no copy
                rows = (x[:, part], weights.view(b, t, k)[:, part], chosen.view(b, t, k)[:, part])
                tiles.append(checkpoint(self._dispatch, *rows, use_reentrant=False)[0].view(b, -1, d))
            y = torch.cat(tiles, dim=1).reshape(n, d)
        else:
            y, dropped = self._dispatch(tokens, weights, chosen, routed, splits)
        if self.shared is not None:
            y = y + self.shared(tokens)
        balance = self._balance(routed, chosen, probs, b, t)
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        aux = self.aux_weight * balance + self.z_weight * z
        # torch.full, not torch.tensor: a fill on the device, no host-to-device copy per forward.
        tokens_seen = torch.full((), float(n), device=x.device)
        extra = torch.stack([dropped.float(), aux.detach(), tokens_seen, balance.detach(), z.detach()])
        stats = torch.cat([routed.detach().float(), extra])
        return y.reshape(b, t, d), aux, stats

    def _dispatch(
        self,
        tokens: torch.Tensor,
        weights: torch.Tensor,
        chosen: torch.Tensor,
        routed: torch.Tensor | None = None,
        splits: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [..., dim] through their chosen experts [..., k], weighted and summed per
        token -> (output [tokens, dim], slots the capacity dropped), the slots per expert
        given (`routed`, `splits`) or counted here (a tile)."""
        tokens, chosen, weights = (
            tokens.reshape(-1, tokens.shape[-1]),
            chosen.reshape(-1, self.top_k),
            weights.reshape(-1, self.top_k),
        )
        n, k, e = tokens.shape[0], self.top_k, self.n_experts
        if routed is None:
            routed, splits = _counts(chosen.reshape(-1), e, n * k, tokens)
        # Token slots sorted by expert (stable: within an expert, in token order).
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        counts, kept = routed, None
        dropped = torch.zeros((), device=tokens.device)
        if self.capacity_factor:
            # Each expert keeps its first `capacity` slots in token order; the dropped ones
            # move behind all kept ones (a stable sort on the flag) and stay rows whose
            # output is zeroed: every size stays n x k, none is read back from the device.
            capacity = math.ceil(self.capacity_factor * n * k / e)
            starts = torch.cumsum(routed, 0) - routed
            kept = torch.arange(n * k, device=tokens.device) - starts[flat[order]] < capacity
            behind = (~kept).to(torch.int32).argsort(stable=True)
            order, kept = order[behind], kept[behind][:, None]
            counts, dropped = routed.clamp(max=capacity), (~kept).sum()
            if splits is not None:  # fake tensors (the planner): balanced, each expert's first slots kept
                splits = [min(s, capacity) for s in splits]
        source = order // k  # the token each slot belongs to
        slot_weights = weights.reshape(-1)[order]
        slots = tokens[source]
        if kept is not None:
            # The grouped kernel leaves the rows past its last offset unwritten, in its
            # forward and in its input gradient: `where` (not a product, which would carry
            # a NaN through) keeps them out of the output and of the tokens' gradient.
            slots = torch.where(kept, slots, 0)
        if self.ep_group is None:
            out = self.experts(slots, counts, splits)
        else:
            out = exchange_slots(self.experts, slots, counts, self.ep_group)
        if kept is not None:
            out = torch.where(kept, out, 0)
        # Under autocast the experts' products come out in its dtype, the tokens in theirs:
        # the sum is taken in the tokens' (index_add_ takes one dtype).
        weighted = (out * slot_weights[:, None].to(out.dtype)).to(tokens.dtype)
        y = torch.zeros_like(tokens).index_add_(0, source, weighted)
        return y, dropped

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's logits [n, e] -> (each token's scores as a distribution over the
        experts, for the balance term; the chosen experts' weights; their indices)."""
        n, e, k = logits.shape[0], self.n_experts, self.top_k
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores if self.expert_bias is None else scores + self.expert_bias  # the bias chooses, never weighs
        if self.topk_groups < self.groups:
            grouped = choice.view(n, self.groups, e // self.groups)
            # A group's score: DeepSeek-V3's sum of its best two (sigmoid), V2's best one (softmax).
            best = grouped.topk(min(2, grouped.shape[-1]) if self.sigmoid else 1, dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, e)
        chosen = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # The balance term's P: softmax scores are a distribution already; sigmoid ones are
        # normalized per token (DeepSeek-V3's s'), a product here so the gradient flows.
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.sigmoid else scores
        return probs, weights, chosen

    def _balance(self, routed: torch.Tensor, chosen: torch.Tensor, probs: torch.Tensor, b: int, t: int) -> torch.Tensor:
        """The Switch balance term, f_e from the routing decisions (no gradient), P_e from
        the probabilities: over the micro-batch (aux), or per sequence and averaged."""
        e, k = self.n_experts, self.top_k
        if not self.per_sequence:
            f = self._whole_sequences(routed.to(torch.float32))
            return e * (f / (b * t * k * self._parts()) * probs.mean(dim=0)).sum()
        # Slots per (sequence, expert): a scatter of static size, nothing read back.
        slots = chosen.reshape(b, t * k)
        per_sequence = torch.zeros(b, e, device=probs.device).scatter_add_(1, slots, torch.ones(slots.shape, device=probs.device))
        share = self._whole_sequences(per_sequence) / (t * k * self._parts())
        return e * (share * probs.reshape(b, t, e).mean(dim=1)).sum(dim=1).mean()

    def _whole_sequences(self, counts: torch.Tensor) -> torch.Tensor:
        """Routing counts over this rank's part of each sequence -> over the whole sequences
        (context parallel: summed over the cp group; they carry no gradient). P_e stays
        this rank's mean: the cp ranks' losses are averaged, and the mean of their P_e
        over equal parts is the whole sequences' P_e, so the average of their terms is
        the term of one process."""
        if self.sequence_group is None:
            return counts
        import torch.distributed as dist

        counts = counts.clone()
        dist.all_reduce(counts, group=self.sequence_group)
        return counts

    def _parts(self) -> int:
        if self.sequence_group is None:
            return 1
        import torch.distributed as dist

        return dist.get_world_size(self.sequence_group)


def split_experts(model: nn.Module, ep_mesh: Any) -> list[nn.Module]:
    """Each MoE layer's experts split over `ep_mesh` (Shard(0) of every stacked weight) and
    its all-to-all group set; returns the expert modules (each FSDP-sharded on its own:
    engines/expert_parallel.py). The built-in model's ExpertSplit.split_experts."""
    experts: list[nn.Module] = []
    for layer in moe_layers(model):
        shard_stacked(layer.experts, ep_mesh)
        layer.ep_group = ep_mesh.get_group()
        experts.append(layer.experts)
    return experts


def shard_stacked(module: nn.Module, mesh: Any) -> None:
    """A module's own stacked expert weights [experts, ...] as DTensors sharded on dim 0 over
    `mesh` (on the meta device: nothing is allocated whole)."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    def dim0(name: str, owner: nn.Module, mesh: Any) -> None:
        for pname, param in list(owner.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
            owner.register_parameter(pname, sharded)

    distribute_module(module, mesh, partition_fn=dim0)


ExpertsFn = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


def exchange_slots(experts: ExpertsFn, slots: torch.Tensor, counts: torch.Tensor, group: Any) -> torch.Tensor:
    """Each slot (sorted by global expert) to its expert's rank, through the local experts
    (`experts(slots sorted by local expert, slots per local expert, the same as a list)`),
    and back in the same order. Rank j of the ep group holds experts [j*E/ep, (j+1)*E/ep)."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    # How many slots every rank sends to each of my experts: [source rank, local expert].
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    # The host needs the split sizes: one read for all of them (what this rank sends to
    # each rank, then the grid it receives), the one host sync per layer and forward that
    # expert parallelism keeps (docs/moe.md).
    sizes = torch.cat([counts.view(ep, local).sum(1), received]).tolist()
    sent_to, grid = sizes[:ep], sizes[ep:]
    from_each = [sum(grid[r * local : (r + 1) * local]) for r in range(ep)]
    kept = sum(sent_to)  # the slots past it were dropped by a capacity: they stay here
    arrived = all_to_all_single_autograd(slots[:kept], from_each, sent_to, group)
    # Arrived slots are grouped by source rank, then by local expert: regroup by expert
    # (stable, so each expert sees rank 0's slots, then rank 1's: token order within each).
    device = slots.device
    key = (torch.arange(local, device=device).view(1, local) * ep + torch.arange(ep, device=device).view(ep, 1)).reshape(-1)
    by_expert = torch.repeat_interleave(key, received, output_size=sum(from_each)).argsort(stable=True)
    splits = [sum(grid[i::local]) for i in range(local)]
    out = experts(arrived[by_expert], received.view(ep, local).sum(0), splits)
    back = torch.empty_like(by_expert)
    back[by_expert] = torch.arange(by_expert.numel(), device=device)
    returned = all_to_all_single_autograd(out[back], sent_to, from_each, group)
    return F.pad(returned, (0, 0, 0, slots.shape[0] - kept)) if slots.shape[0] > kept else returned


def _local(weight: torch.Tensor) -> torch.Tensor:
    """An expert-parallel weight's own experts (its DTensor shard on dim 0); a plain one as is."""
    from torch.distributed.tensor import DTensor

    return weight.to_local() if isinstance(weight, DTensor) else weight


def _counts(flat: torch.Tensor, experts: int, slots: int, like: torch.Tensor) -> tuple[torch.Tensor, list[int] | None]:
    """Token slots per expert (and, when known without reading the device, as a list);
    balanced under FakeTensorMode (see the module's docstring)."""
    if isinstance(like, torch._subclasses.FakeTensor) or like.is_meta:
        base, extra = divmod(slots, experts)
        splits = [base + (i < extra) for i in range(experts)]
        return torch.tensor(splits, device=flat.device), splits
    # A scatter, not bincount: CUDA's bincount reads the largest value back to size its
    # output (a host sync), and its size is data to a compiler; this one is `experts`.
    return torch.zeros(experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat)), None


def routing_stats(model: nn.Module) -> Callable[[], torch.Tensor | None]:
    """A function that returns the routing statistics the model's training forwards summed
    since its last call ([MoE layers, experts + EXTRA_STATS], on the device) and resets
    them; None for a dense model, or once the model is gone. The module that holds them
    is found once, through any engine's wrappers (DDP, FSDP, DeepSpeed), and held by a
    weak reference: telemetry must not keep a released model (and its process group) alive."""
    refs = [weakref.ref(holder) for holder in _holders(model)]
    if not refs:  # a model without them (Hugging Face's)
        return lambda: None

    def take() -> torch.Tensor | None:
        taken = []
        for ref in refs:
            module = ref()
            if module is None:
                return None
            taken.append(getattr(module, "moe_stats"))  # noqa: B009  # set by Llama, absent from the type nn.Module
            setattr(module, "moe_stats", None)  # noqa: B010
        # Each of a pipeline rank's stages fills its own rows of the whole table (Llama.forward).
        held = [stats for stats in taken if stats is not None]
        return None if not held else held[0] if len(held) == 1 else torch.stack(held).sum(0)

    return take


def _holders(model: Any) -> list[nn.Module]:
    """The modules that count the routing statistics: the model (through any engine's
    wrappers), or each stage a pipeline rank runs (engines/pipeline.py MergedStages.stages)."""
    if not isinstance(model, nn.Module):
        return []
    # The module's own attribute, not one reached through a wrapper's forwarding __getattr__
    # (DeepSpeed's engine answers for its module, and a reset there would shadow the model's).
    stages = vars(model).get("stages", [model])
    return [m for stage in stages for m in stage.modules() if "moe_stats" in vars(m)]


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's mixture-of-experts layers, in order (none in a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


class ExpertBias:
    """model.moe.balance=bias (DeepSeek-V3's auxiliary-loss-free balancing): each MoE
    layer's expert bias, one fp32 table [MoE layers, experts] on the device whose rows the
    layers route with, moved after each optimizer step by `rate` x sign(mean load - load):
    an expert that took more than its share of the step's slots is chosen a little less.

    The load is the whole step's: the model sums each training forward's slots per expert
    (Llama.forward, every micro-batch of the accumulation) and `reduce` sums them over every
    data-parallel rank in place, one collective per step on the device, nothing read back.
    So every rank moves the same bias, and how the step's sequences are split into
    micro-batches and ranks does not change it. The table is saved in trainer.json
    (`state`, `load`): the engines' state holds parameters only, and a JSON list of floats
    goes to any world size and engine as it is.
    """

    def __init__(self, model: nn.Module, rate: float, device: torch.device, reduce: Callable[[torch.Tensor], None]):
        holders = _holders(model)
        shape: ModelShape = getattr(holders[0], "shape")  # noqa: B009  # the whole model's: a stage holds some of its layers
        self.rate, self.reduce = rate, reduce
        self.table = torch.zeros(shape.moe_layers, shape.experts, device=device)
        for layer in moe_layers(model):
            layer.expert_bias = self.table[layer.row]  # a view: the layer routes with the table's current values
        # One load for all of a rank's stages: each adds its own rows (Llama.forward), and
        # `reduce` over every rank fills the rest from the other stages' ranks.
        load = torch.zeros(self.table.shape, dtype=torch.float64, device=device)
        for holder in holders:
            setattr(holder, "moe_load", load)  # noqa: B010
        # Weak: the run's collaborators must not keep a released model alive (routing_stats says why).
        self._holder = weakref.ref(holders[0])

    def after_step(self) -> None:
        holder = self._holder()
        if holder is None:
            return
        load = getattr(holder, "moe_load")  # noqa: B009  # set above, absent from the type nn.Module
        self.reduce(load)
        # sign, not the load itself: the step's size and the slots' count do not matter, and a
        # load exactly at the mean leaves its bias where it is.
        self.table.add_(self.rate * torch.sign(load.mean(dim=1, keepdim=True) - load).float())
        load.zero_()

    def state(self) -> list[list[float]]:
        """The table for trainer.json (a host read: at a checkpoint only)."""
        return self.table.tolist()

    # Stateful (training/state.py): the table, TrainerState's `expert_bias`.
    def state_dict(self) -> dict[str, Any]:
        return {"expert_bias": self.state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.load(state.get("expert_bias"))

    def load(self, saved: list[list[float]] | None) -> None:
        """A checkpoint's table back (None: a checkpoint without one starts from zeros)."""
        if saved is None:
            self.table.zero_()
            return
        values = torch.tensor(saved, dtype=torch.float32)
        if values.shape != self.table.shape:
            from scaletrain.errors import UserError

            raise UserError(
                f"the checkpoint's expert bias is {list(values.shape)} (MoE layers x experts), this model's "
                f"{list(self.table.shape)}; accepted: a checkpoint of this model"
            )
        self.table.copy_(values)


def attach_expert_bias(
    cfg: Any, model: nn.Module, device: torch.device, saved: list[list[float]] | None, reduce: Callable[[torch.Tensor], None]
) -> ExpertBias | None:
    """The model's ExpertBias under model.moe.balance=bias (cfg: the whole Config), holding
    a checkpoint's table where `saved` gives one; None for any other balance."""
    moe = cfg.model.moe
    if moe is None or moe.balance != "bias":
        return None
    bias = ExpertBias(model, moe.bias_update_rate, device, reduce)
    bias.load(saved)
    return bias
