"""Model shapes: named presets and config overrides, checked.

Nothing here allocates a model. The big presets copy the published Llama configurations,
so their parameter counts (models/spec.py, from the meta-device model) match the
published totals (tests check this).
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config import ModelSource
from scaletrain.config.presets import PRESETS
from scaletrain.errors import UserError


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    tie_embeddings: bool
    rope_theta: float
    norm_eps: float
    # A mixture of experts in the feed-forward of every block from `dense_layers` on
    # (models/moe.py); experts 0: a dense model.
    experts: int = 0
    top_k: int = 0
    shared_experts: int = 0
    expert_ffn_dim: int = 0
    dense_layers: int = 0
    capacity_factor: float = 0.0  # 0: dropless
    normalize_top_k: bool = True
    aux_loss_weight: float = 0.0
    balance: str = "sequence_aux"  # model.moe.balance: sequence_aux | aux | bias (models/moe.py)
    score: str = "softmax"  # model.moe.score: softmax | sigmoid
    groups: int = 1  # group-limited routing: the experts in `groups` groups, each token's
    topk_groups: int = 1  # experts within its best topk_groups of them
    z_loss_weight: float = 0.0
    experts_impl: str = "auto"  # how the experts run (models/moe.py); no tensor's shape
    # Qwen3's attention: heads wider than dim / n_heads (0: dim / n_heads, Llama's), and an
    # RMSNorm over each head's queries and keys before the rotary embedding.
    attention_head_dim: int = 0
    qk_norm: bool = False

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def moe_layers(self) -> int:
        return max(0, self.n_layers - self.dense_layers) if self.experts else 0


_SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings", "rope_theta", "norm_eps")
# model.moe's fields, over a preset's (moe.experts etc.); unset ones keep the preset's or these.
MOE_DEFAULTS = dict(experts=8, top_k=2, shared_experts=0, dense_layers=0, capacity_factor=0.0, normalize_top_k=True)


def resolve_shape(cfg: ModelSource, vocab_size: int | None = None) -> ModelShape:
    """The preset's shape with every field set in `cfg` overriding it, then checked.

    Vocabulary: `cfg.vocab_size` if set, else `vocab_size` (the tokenizer's), else the
    preset's published one; the CPU presets have none, so one of the first two is required.
    """
    base = dict(PRESETS[cfg.preset])
    for key in _SHAPE_KEYS:
        value = getattr(cfg, key)
        if value is not None:
            base[key] = value

    if cfg.vocab_size is not None:
        # A vocabulary smaller than the tokenizer's would index past the embedding table at
        # the first rare token, long after startup; larger (padding) is harmless.
        if vocab_size is not None and cfg.vocab_size < vocab_size:
            raise UserError(
                f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's vocabulary of "
                f"{vocab_size} tokens; set model.vocab_size >= {vocab_size} or leave it unset"
            )
        base["vocab_size"] = cfg.vocab_size
    elif vocab_size is not None:
        base["vocab_size"] = vocab_size
    if base["vocab_size"] is None:
        raise UserError(
            f"model.preset={cfg.preset} takes its vocabulary size from the tokenizer, and none was "
            f"given; set model.vocab_size=N (an integer >= 2) or resolve the shape with a tokenizer"
        )

    if cfg.moe is not None:
        moe = {k: v for k, v in cfg.moe.model_dump().items() if v is not None}
        for key, default in MOE_DEFAULTS.items():
            base[key] = moe.get(key, base.get(key, default))
        base["expert_ffn_dim"] = moe.get("expert_ffn_dim", base.get("expert_ffn_dim") or base["ffn_dim"])
        base["aux_loss_weight"] = aux_loss_weight(cfg.moe.balance, cfg.moe.aux_loss_weight)
        base["z_loss_weight"], base["balance"] = cfg.moe.z_loss_weight, cfg.moe.balance
        base["experts_impl"] = cfg.moe.experts_impl
        base["score"] = moe.get("score", base.get("score", "softmax"))
        base["groups"] = moe.get("groups", base.get("groups", 1))
        if "topk_groups" in moe and base["groups"] == 1:  # a limit among one group would limit nothing
            raise UserError(
                f"model.moe.topk_groups={moe['topk_groups']} picks each token's best groups of experts, but the experts "
                "are in one group (model.moe.groups unset, and the preset has none); accepted: model.moe.groups=G "
                "(a divisor of the experts) with it, or no topk_groups"
            )
        base["topk_groups"] = moe.get("topk_groups", base.get("topk_groups", base["groups"]))
    elif base.get("experts"):  # a mixture-of-experts preset: the auxiliary losses' defaults
        base["aux_loss_weight"], base["z_loss_weight"] = AUX_LOSS_WEIGHT, Z_LOSS_WEIGHT
    shape = ModelShape(**base)
    _check(shape)
    return shape


# Mixtral's router_aux_loss_coef; DeepSeek-V3's sequence-wise balance weight beside its bias
# (alpha); ST-MoE's router z-loss coefficient.
AUX_LOSS_WEIGHT = 0.02
BIAS_AUX_LOSS_WEIGHT = 0.0001
Z_LOSS_WEIGHT = 0.001


def aux_loss_weight(balance: str, given: float | None) -> float:
    """model.moe.aux_loss_weight, or its default for the balance."""
    if given is not None:
        return given
    return BIAS_AUX_LOSS_WEIGHT if balance == "bias" else AUX_LOSS_WEIGHT


def _check(s: ModelShape) -> None:
    # Head counts must split `dim` evenly, and RoPE rotates pairs of channels, so head_dim is even.
    good_heads = [h for h in range(1, s.dim + 1) if s.dim % h == 0 and (s.dim // h) % 2 == 0]
    if s.dim % s.n_heads != 0 and not s.attention_head_dim:
        raise UserError(
            f"model.n_heads={s.n_heads} does not divide model.dim={s.dim}; choose n_heads among {_listing(good_heads)}"
        )
    if s.head_dim % 2 != 0:
        raise UserError(
            f"model.dim={s.dim} / model.n_heads={s.n_heads} gives head_dim={s.head_dim}, which must be "
            f"even for rotary embeddings; choose n_heads among {_listing(good_heads)}"
        )
    if s.experts and not 1 <= s.top_k <= s.experts:
        raise UserError(f"model.moe.top_k={s.top_k} must be between 1 and model.moe.experts={s.experts}")
    if s.experts and (s.experts % s.groups or not 1 <= s.topk_groups <= s.groups):
        raise UserError(
            f"model.moe.groups={s.groups} and topk_groups={s.topk_groups} do not fit {s.experts} experts; accepted: groups "
            f"dividing model.moe.experts ({_listing([g for g in range(1, s.experts + 1) if s.experts % g == 0])}) and "
            "1 <= topk_groups <= groups"
        )
    if s.experts and s.top_k > s.topk_groups * (s.experts // s.groups):
        raise UserError(
            f"model.moe.top_k={s.top_k} experts cannot be chosen within topk_groups={s.topk_groups} of groups={s.groups} "
            f"({s.experts // s.groups} experts each); accepted: top_k <= {s.topk_groups * (s.experts // s.groups)}, or more "
            "topk_groups"
        )
    if s.experts and s.experts_impl == "grouped" and (s.dim % 8 or s.expert_ffn_dim % 8):
        # torch._grouped_mm takes rows of a multiple of 16 bytes (8 bf16 elements).
        raise UserError(
            f"model.moe.experts_impl=grouped needs model.dim={s.dim} and the expert width {s.expert_ffn_dim} "
            "(model.moe.expert_ffn_dim) to be multiples of 8 (torch._grouped_mm's rows); accepted: such widths, "
            "or model.moe.experts_impl=auto|loop"
        )
    if s.experts and s.dense_layers >= s.n_layers:
        raise UserError(
            f"model.moe.dense_layers={s.dense_layers} leaves no mixture-of-experts block of {s.n_layers}; "
            f"accepted: 0..{s.n_layers - 1}"
        )
    if s.n_heads % s.n_kv_heads != 0:
        good_kv = [k for k in range(1, s.n_heads + 1) if s.n_heads % k == 0]
        raise UserError(
            f"model.n_kv_heads={s.n_kv_heads} does not divide model.n_heads={s.n_heads}; "
            f"choose n_kv_heads among {_listing(good_kv)}"
        )


def _listing(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (", ..." if len(values) > limit else "")
