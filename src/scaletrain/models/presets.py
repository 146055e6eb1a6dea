"""Model shapes: named presets and config overrides, checked.

Nothing here allocates a model. The big presets copy the published Llama configurations,
so their parameter counts (models/spec.py, from the meta-device model) match the
published totals (tests check this).
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config import ModelSource
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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# vocab_size None: the CPU presets take the vocabulary of the tokenizer trained for the run.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=None,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=384,
        tie_embeddings=True,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    "small": dict(
        vocab_size=None,
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=704,
        tie_embeddings=True,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    # Llama-3.2-1B: 1.24B parameters.
    "1b": dict(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        tie_embeddings=True,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
    # Llama-2-7B: 6.74B parameters (multi-head attention, no GQA).
    "7b": dict(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=11008,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    # Llama-3-8B: 8.03B parameters.
    "8b": dict(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        tie_embeddings=False,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
    # Llama-3-70B: 70.6B parameters.
    "70b": dict(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        tie_embeddings=False,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
    # Llama-3.1-405B: 405.9B parameters.
    "405b": dict(
        vocab_size=128256,
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        tie_embeddings=False,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
}

_SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings", "rope_theta", "norm_eps")


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

    shape = ModelShape(**base)
    _check(shape)
    return shape


def _check(s: ModelShape) -> None:
    # Head counts must split `dim` evenly, and RoPE rotates pairs of channels, so head_dim is even.
    good_heads = [h for h in range(1, s.dim + 1) if s.dim % h == 0 and (s.dim // h) % 2 == 0]
    if s.dim % s.n_heads != 0:
        raise UserError(
            f"model.n_heads={s.n_heads} does not divide model.dim={s.dim}; choose n_heads among {_listing(good_heads)}"
        )
    if s.head_dim % 2 != 0:
        raise UserError(
            f"model.dim={s.dim} / model.n_heads={s.n_heads} gives head_dim={s.head_dim}, which must be "
            f"even for rotary embeddings; choose n_heads among {_listing(good_heads)}"
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
