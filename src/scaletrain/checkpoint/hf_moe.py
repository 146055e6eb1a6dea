"""The built-in mixture of experts (models/moe.py) as a Hugging Face Mixtral.

Mixtral's block is the built-in one with every feed-forward a mixture: a router (`gate`, a
Linear dim -> experts), fp32 softmax, top-k renormalized to sum 1, SwiGLU experts, no
shared expert, no token dropped. The tensors are written as `save_pretrained` writes a
Mixtral (transformers 5.23, whose model holds the experts fused, converts them to this
on saving and back on loading): one Linear per expert and projection,
`model.layers.N.block_sparse_moe.experts.E.w1.weight` [hidden, dim], the layout of the
published Mixtral checkpoints, which older transformers and other readers load too. Our
stacked w1 [E, dim, hidden] is x @ w1[e]; a Linear computes x @ W.T, so W = w1[e].T (the
same for w3, the up projection, and w2, the down one): a slice and a transpose, no
arithmetic, so an fp32 export holds the trained numbers exactly.

What Mixtral has no field for is refused (`check_expressible`): shared experts, dense
blocks among the mixtures, top-k weights left unnormalized, and a capacity (Mixtral is
dropless). The auxiliary losses are training terms, not part of the model's function:
router_aux_loss_coef is model.moe.aux_loss_weight, but Mixtral's load-balancing term is
pooled over the layers (and is top_k, not 1, when balanced) where ours is one term per
layer, summed; the router z-loss has no Mixtral field and is left out.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from scaletrain.errors import UserError
from scaletrain.models.presets import ModelShape

# (Hugging Face name, its shape, the part of the checkpoint tensor it holds)
Piece = tuple[str, torch.Size, Callable[[torch.Tensor], torch.Tensor]]

_ROUTER = re.compile(r"^layers\.(\d+)\.feed_forward\.router\.weight$")
_EXPERTS = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")


def check_expressible(shape: ModelShape) -> None:
    """A one-line UserError naming every field of the mixture Mixtral cannot express."""
    off = []
    if shape.shared_experts:
        off.append(f"model.moe.shared_experts={shape.shared_experts}")
    if shape.dense_layers:
        off.append(f"model.moe.dense_layers={shape.dense_layers}")
    if not shape.normalize_top_k:
        off.append("model.moe.normalize_top_k=false")
    if shape.capacity_factor:
        off.append(f"model.moe.capacity_factor={shape.capacity_factor:g}")
    if shape.score != "softmax":
        off.append(f"model.moe.score={shape.score}")
    if shape.topk_groups < shape.groups:
        off.append(f"model.moe.topk_groups={shape.topk_groups} of groups={shape.groups}")
    if shape.balance == "bias":  # the bias changes which experts each token takes
        off.append("model.moe.balance=bias (its routing bias)")
    if shape.qk_norm or shape.attention_head_dim:  # a Qwen3-MoE preset: its own format, not written yet
        off.append("Qwen3's attention (its head width and query/key norms)")
    if off:
        raise UserError(
            f"--format hf: {', '.join(off)} {'has' if len(off) == 1 else 'have'} no Hugging Face Mixtral equivalent; "
            "accepted: a mixture of experts with shared_experts=0, dense_layers=0, normalize_top_k=true, "
            "capacity_factor=0, softmax scores, no group limit and balance=sequence_aux|aux (exported as MixtralForCausalLM)"
        )


def mixtral_name(name: str) -> str | None:
    """The router's Hugging Face name (None for any other tensor)."""
    found = _ROUTER.match(name)
    return f"model.layers.{found[1]}.block_sparse_moe.gate.weight" if found else None


def expert_pieces(name: str, shape: torch.Size) -> list[Piece] | None:
    """A stacked expert weight as one Linear weight per expert (None for any other tensor)."""
    found = _EXPERTS.match(name)
    if found is None:
        return None
    layer, which = found[1], found[2]
    experts, rows, cols = shape
    prefix = f"model.layers.{layer}.block_sparse_moe.experts"
    return [(f"{prefix}.{e}.{which}.weight", torch.Size([cols, rows]), _expert(e)) for e in range(experts)]


def _expert(e: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda stacked: stacked[e].T


def mixtral_config(llama: dict[str, Any], shape: ModelShape) -> dict[str, Any]:
    """config.json of a MixtralForCausalLM: the Llama export's fields (same attention, norms,
    embeddings) and the mixture's."""
    out = {k: v for k, v in llama.items() if k not in ("mlp_bias", "attention_bias", "rope_scaling")}
    return out | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": shape.expert_ffn_dim,  # Mixtral's only feed-forward width is the experts'
        "num_local_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "router_aux_loss_coef": shape.aux_loss_weight,
        # transformers adds router_aux_loss_coef x its balance term to a loss with labels
        # only when this is set: a fine-tune of the export keeps the balancing it trained with.
        "output_router_logits": shape.aux_loss_weight > 0,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "attention_dropout": 0.0,
        # As transformers 5 writes it (its Mixtral's default theta is 1e6, the built-in
        # presets' 1e4), beside rope_theta, which older readers take.
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
    }
