"""The run configuration: one typed schema (schema.py) and its sections (model, data, eval,
float8, ft), read from YAML files and dotted overrides (load.py); the batch arithmetic
(batch.py), the parallel layout (parallel.py) and the pipeline stages (stages.py) that follow
from it. All torch-free, so a bad config is answered before torch is imported.
"""

from scaletrain.config.data import DataConfig
from scaletrain.config.load import load_config, split_args
from scaletrain.config.model import ModelConfig, ModelSource
from scaletrain.config.schema import AUTO_MICRO_BATCH, Config, TelemetryConfig, TrainConfig

__all__ = [
    "AUTO_MICRO_BATCH",
    "Config",
    "DataConfig",
    "ModelConfig",
    "ModelSource",
    "TelemetryConfig",
    "TrainConfig",
    "load_config",
    "split_args",
]
