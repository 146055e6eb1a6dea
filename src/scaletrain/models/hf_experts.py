"""Expert parallel (`parallel.ep`) for a Hugging Face mixture of experts: transformers 5's
stacked experts (Mixtral, Qwen2-MoE, Qwen3-MoE and every other model whose experts class
transformers decorates with `use_experts_implementation`) split over the ep ranks as the
built-in model's are (engines/expert_parallel.py).

transformers holds a layer's experts in one module with two stacked weights, gate_up_proj
[E, 2 x hidden, dim] and down_proj [E, dim, hidden], called by the layer's sparse block as
`experts(tokens, top_k_index, top_k_weights)`; the router, the shared expert (Qwen2-MoE)
and the balance term stay outside it. So the split replaces nothing of the model's: the
two weights become Shard(0) DTensors over the ep mesh, and the module's forward is swapped
(through transformers' own experts interface, the extension point its kernels use) for one
that sorts the token slots by expert, sends them to their experts' ranks and back
(models/moe.py `exchange_slots`), and weighs and sums them per token as transformers'
eager forward does. Each rank runs its E/ep experts with the module's own gate
(`_apply_gate`: the activation of the gate half times the up half): two grouped products
over all of them where torch's kernel runs without a host sync (models/grouped_mm.py),
else one expert at a time.

Only the layout transformers' eager forward computes is taken (concatenated gate and up,
not transposed, no biases, no norm after the experts); another is refused in one line
naming the model type. The weights' names and global shapes do not change, so checkpoints,
their resharding and the Hugging Face export are as without ep.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.grouped_mm import group_offsets, grouped_linear, uses_grouped_mm
from scaletrain.models.moe import exchange_slots, shard_stacked

# The name our forward is registered under in transformers' ExpertsInterface.
IMPLEMENTATION = "scaletrain_expert_parallel"
# The layout transformers' eager experts forward computes (use_experts_implementation's flags).
LAYOUT = {"has_bias": False, "is_transposed": False, "has_gate": True, "is_concatenated": True, "has_post_expert_norm": False}


def stacked_experts(model: nn.Module) -> list[nn.Module]:
    """transformers' stacked expert modules of `model`, in order (none for a dense model):
    those use_experts_implementation decorated (it sets `_is_expert_parallel`, which only its
    own kernels read) holding a stacked down_proj."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "_is_expert_parallel") and isinstance(getattr(m, "down_proj", None), nn.Parameter)
    ]


def split_stacked_experts(model: nn.Module, ep_mesh: Any, model_type: str) -> list[nn.Module]:
    """Each stacked experts module's weights split over `ep_mesh` and its forward exchanged
    for the ep one; returns the modules (FSDP shards each on its own)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    key = f"parallel.ep={ep_mesh.size()}"
    modules = stacked_experts(model)
    if not modules:
        raise UserError(
            f"{key} splits transformers' stacked experts; model_type {model_type} has none (its experts, if any, are "
            "modules of their own); accepted: parallel.ep=1 (fsdp and zero3 shard its weights, experts included)"
        )
    for module in modules:
        odd = [f"{flag}={getattr(module, flag)}" for flag, want in LAYOUT.items() if getattr(module, flag, want) != want]
        if odd:
            raise UserError(
                f"{key}: model_type {model_type}'s experts ({type(module).__name__}) have {', '.join(odd)}, a layout the "
                "split does not compute yet; accepted: parallel.ep=1"
            )
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _forward)
    for module in modules:
        shard_stacked(module, ep_mesh)
        setattr(module, "ep_group", ep_mesh.get_group())  # noqa: B010  # read by _forward
        # The module's config is the model's: every experts module then dispatches here.
        module.config._experts_implementation = IMPLEMENTATION  # type: ignore[union-attr]
    return modules


def _forward(module: Any, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts call: tokens [n, dim], each token's k experts and their weights
    [n, k] -> [n, dim], the weighted sum of its experts' outputs."""
    n, k = top_k_index.shape
    experts = module.num_experts  # transformers' experts modules all have it
    flat = top_k_index.reshape(-1)
    # Slots per expert by a scatter of static size (nothing read back but the split sizes
    # exchange_slots needs), then the slots sorted by expert, stable: token order within each.
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    order = flat.argsort(stable=True)
    source = order // k
    out = exchange_slots(partial(_local_experts, module), tokens[source], counts, module.ep_group)
    weighted = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
    return torch.zeros_like(tokens).index_add_(0, source, weighted.to(tokens.dtype))


def _local_experts(module: Any, slots: torch.Tensor, counts: torch.Tensor, splits: list[int]) -> torch.Tensor:
    """This rank's experts, each on its contiguous run of `slots` (`counts` of them, the
    same as a list in `splits`), as transformers' eager forward computes one: gate_up, the
    gate, down. Grouped (two grouped products over all local experts, as the built-in
    model's, models/grouped_mm.py) where torch runs the kernel without a host sync; else a
    loop in which every expert runs, an empty one too, so each weight has a gradient on
    every rank (zero where no slot came; the grouped weight gradient is zero there too)."""
    from torch.distributed.tensor import DTensor

    gate_up, down = (w.to_local() if isinstance(w, DTensor) else w for w in (module.gate_up_proj, module.down_proj))
    up_t, down_t = gate_up.transpose(-2, -1), down.transpose(-2, -1)  # [experts, in, out] views
    # auto: grouped where the kernel runs without a sync (a test sets loop or grouped to compare them).
    if uses_grouped_mm(getattr(module, "experts_impl", "auto"), slots, down_t):
        offsets = group_offsets(counts)
        return grouped_linear(module._apply_gate(grouped_linear(slots, up_t, offsets)), down_t, offsets)
    parts = slots.split(splits)
    return torch.cat([F.linear(module._apply_gate(F.linear(p, gate_up[i])), down[i]) for i, p in enumerate(parts)])
