"""Model definitions: Llama-style decoder, shape presets, parameter and FLOP arithmetic."""

from scaletrain.models.llama import Llama, TransformerBlock, build_meta_model, build_model, loss_fn, materialize
from scaletrain.models.presets import PRESETS, ModelShape, count_params, flops_per_token, resolve_shape

__all__ = [
    "PRESETS",
    "Llama",
    "ModelShape",
    "TransformerBlock",
    "build_meta_model",
    "build_model",
    "count_params",
    "flops_per_token",
    "loss_fn",
    "materialize",
    "resolve_shape",
]
