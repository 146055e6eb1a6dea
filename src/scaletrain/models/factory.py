"""The model spec a config (or a saved checkpoint) describes, built by its model.source's
module (config/sources.py: the built-in Llama's models/spec.py, Hugging Face's models/hf.py,
a model of your own's models/module_spec.py). Callers never construct a spec class themselves."""

from __future__ import annotations

import importlib
from typing import Any

from scaletrain.config.sources import SOURCES
from scaletrain.errors import UserError
from scaletrain.models.distill import Distill, HiddenStates, Observed, WithProjection, final_norm
from scaletrain.models.lora import LoraSpec
from scaletrain.models.params import PROJECTION
from scaletrain.models.spec import ModelSpec


def model_spec(cfg: Any, vocab_size: int | None, eos_id: int | None = None) -> ModelSpec:
    """`cfg.model` as a spec; `vocab_size` is the tokenizer's (None before one exists), and
    `eos_id` its end of document, which data.document_mask needs (the planner, without a
    tokenizer, leaves it out: any id gives the same shapes)."""
    m = cfg.model
    eos = _document_eos(cfg, eos_id)
    spec = _spec(m, vocab_size, cfg.train.loss_chunk_tokens, tuple(m.trainable), m.lora, eos, bool(cfg.train.compile))
    if m.teacher is not None and m.teacher.hidden_weight > 0:  # + the projection to the teacher's width
        return WithProjection(spec, _spec(m.teacher, vocab_size, 0, (), None, eos).hidden_size, HiddenStates())
    return spec


def _document_eos(cfg: Any, eos_id: int | None) -> int | None:
    if not cfg.data.document_mask:
        return None
    for m in (cfg.model, cfg.model.teacher):
        if m is not None and not SOURCES[m.source].document_mask:
            raise UserError(
                f"data.document_mask=true needs the built-in model: {m.where}.source={m.source!r} computes its own "
                "attention mask and positions; accepted: data.document_mask=false, or model.source=builtin"
            )
    return 0 if eos_id is None else eos_id


def distill_spec(cfg: Any, student: ModelSpec) -> Distill | None:
    """`cfg.model.teacher` beside the student `student` (model_spec's); None without a teacher."""
    t = cfg.model.teacher
    if t is None:
        return None
    # A wrapper (WithProjection) answers for the spec it wraps.
    teacher = _spec(t, student.vocab_size, 0, (), None, getattr(student, "document_eos", None))
    if teacher.vocab_size != student.vocab_size:
        # The KL compares the two distributions token by token over one vocabulary.
        raise UserError(
            f"model.teacher has a vocabulary of {teacher.vocab_size} tokens and the model {student.vocab_size}; accepted: "
            "a teacher and a student over the same tokenizer and vocabulary size"
        )
    if isinstance(student, WithProjection):  # the hidden-state term: both forwards leave theirs
        final_norm(teacher.build_meta(1))  # a model without one stops here, in one line
        return Distill(
            Observed(teacher, student.hidden), t.temperature, t.kl_weight, student.loss, t.hidden_weight, student.hidden
        )
    return Distill(teacher, t.temperature, t.kl_weight, student.loss)


def _spec(
    m: Any,
    vocab_size: int | None,
    chunk: int,
    trainable: tuple[str, ...],
    lora: Any,
    document_eos: int | None = None,
    compiled: bool = False,
) -> ModelSpec:
    # train.compile compiles the chunked loss with the blocks (models/loss.py); the whole one is one aten kernel already
    common: dict[str, Any] = {"loss_chunk_tokens": chunk, "loss_compiled": compiled and chunk > 0, "trainable": trainable}
    spec: ModelSpec = _source(m.source).from_section(m, vocab_size, lora, document_eos, common)
    return spec


def saved_spec(saved_model: dict[str, Any]) -> ModelSpec:
    """The spec a checkpoint's trainer.json "model" entry (spec.config()) describes. Its
    weights come from the checkpoint, so a Hugging Face model needs no directory."""
    fields = dict(saved_model)
    fields.pop(PROJECTION, None)  # distillation's projection: the student's own model has none
    lora = fields.pop("lora", None)
    adapters = LoraSpec(lora["r"], lora["alpha"], lora["dropout"], tuple(lora["target_modules"])) if lora else None
    spec: ModelSpec = _source(fields.get("source", "builtin")).from_saved(fields, adapters)  # the built-in's names none
    return spec


def _source(name: str) -> Any:
    """The module that builds model.source `name`'s specs (config/sources.py)."""
    return importlib.import_module(SOURCES[name].module)
