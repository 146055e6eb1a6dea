"""scaletrain: plan, run, watch and recover distributed LLM training.

The Python API (api.py, docs/api.md): load_config, plan, train, evaluate, and ModuleSpec
for a model of your own (models/module_spec.py) with the capabilities' protocols its offers
take (TensorParallel, PipelineStages, ContextChunks, ExpertSplit: models/capabilities.py). Importing the package changes nothing in
the process (its environment, PATH, the collector) and imports neither torch nor pydantic;
the functions import what they run when called, ModuleSpec on first use.
"""

from typing import Any

from scaletrain.api import RunSummary, evaluate, load_config, plan, train
from scaletrain.errors import UserError

__version__ = "0.1.0"

CAPABILITIES = ("TensorParallel", "PipelineStages", "ContextChunks", "ExpertSplit")
__all__ = [
    "ModuleSpec", *CAPABILITIES, "RunSummary", "UserError", "__version__", "evaluate", "load_config", "plan", "train",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name == "ModuleSpec":  # imports torch: only when a model file asks for it
        from scaletrain.models.module_spec import ModuleSpec

        return ModuleSpec
    if name in CAPABILITIES:
        from scaletrain.models import capabilities

        return getattr(capabilities, name)
    raise AttributeError(f"module 'scaletrain' has no attribute {name!r}")
