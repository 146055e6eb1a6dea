"""scaletrain: plan, run, watch and recover distributed LLM training."""

__version__ = "0.1.0"
