"""The planner: memory by component, communication and time for every strategy, and the choice.

Pure arithmetic over a model spec and a layout (tracing on fake tensors included): no
process group, no engine, no training loop; those use the planner, never the reverse.
"""

from __future__ import annotations

from scaletrain.config import Config
from scaletrain.config.sources import SOURCES
from scaletrain.data.remote import store_options
from scaletrain.models import ModelSpec, model_spec
from scaletrain.planning.candidate import Candidate, Plan
from scaletrain.planning.memory import Memory, estimate
from scaletrain.planning.planner import make_plan
from scaletrain.planning.setup import Setup


def planning_spec(cfg: Config) -> ModelSpec:
    """The model to plan for before any tokenizer exists: the preset's vocabulary, or (CPU
    presets) the size of the tokenizer the run would train."""
    has_vocab = SOURCES[cfg.model.source].knows_vocab(cfg.model)
    spec = model_spec(cfg, None if has_vocab else cfg.data.vocab_size)
    return _with_documents(cfg, spec) if cfg.data.document_mask else spec


def _with_documents(cfg: Config, spec: ModelSpec) -> ModelSpec:
    """Under data.document_mask, the attention the documents leave (the FLOPs and so the
    time), from the data where it is prepared already; else the whole sequence's."""
    from scaletrain.data import MANIFEST, PackedTokens, resolve_dataset_dir
    from scaletrain.errors import UserError
    from scaletrain.models.documents import measured_context
    from scaletrain.models.spec import with_fields

    try:
        where, _ = resolve_dataset_dir(cfg.data)
        if cfg.data.mix or not (where / MANIFEST).is_file():
            return spec
        data = PackedTokens(where, cfg.data.seq_len, cfg.train.seed, held_out=cfg.eval.held_out, store=store_options(cfg.data))
    except UserError:  # the run says what is wrong with its data; a plan does without it
        return spec
    return with_fields(spec, mean_context=measured_context(data))


__all__ = ["Candidate", "Memory", "Plan", "Setup", "estimate", "make_plan", "planning_spec"]
