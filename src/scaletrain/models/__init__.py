"""Models: the spec protocol engines and the planner use, the built-in Llama, its shapes."""

from scaletrain.models.factory import distill_spec, model_spec, saved_spec
from scaletrain.models.llama import Llama, TransformerBlock, build_meta_model, build_model, loss_fn, materialize
from scaletrain.models.presets import PRESETS, ModelShape, resolve_shape
from scaletrain.models.spec import LlamaSpec, LossFn, ModelCounts, ModelSpec, count_params, flops_per_token

__all__ = [
    "PRESETS",
    "Llama",
    "LlamaSpec",
    "LossFn",
    "ModelCounts",
    "ModelShape",
    "ModelSpec",
    "TransformerBlock",
    "build_meta_model",
    "build_model",
    "count_params",
    "flops_per_token",
    "loss_fn",
    "materialize",
    "distill_spec",
    "model_spec",
    "resolve_shape",
    "saved_spec",
]
