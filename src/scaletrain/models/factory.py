"""The model spec a config (or a saved checkpoint) describes: the built-in Llama or a
Hugging Face model. Callers never construct a spec class themselves."""

from __future__ import annotations

import json
from typing import Any

from scaletrain.errors import UserError
from scaletrain.models.distill import Distill, HiddenStates, Observed, WithProjection, final_norm
from scaletrain.models.hf import HFSpec, load_config
from scaletrain.models.lora import LoraSpec, lora_spec
from scaletrain.models.module_spec import from_import, with_source
from scaletrain.models.params import PROJECTION
from scaletrain.models.presets import ModelShape, resolve_shape
from scaletrain.models.spec import LlamaSpec, ModelSpec


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
        if m is not None and m.source != "builtin":
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
    if m.source == "python":  # a model of your own (models/module_spec.py)
        return with_source(from_import(m.spec, m.spec_args, vocab_size, m.where), m.spec, m.spec_args, **common)
    if m.source == "builtin":
        return LlamaSpec(resolve_shape(m, vocab_size), lora=lora_spec(lora, None), document_eos=document_eos, **common)
    conf = load_config(m.path, m.hf_config, vocab_size, m.where)
    common["lora"] = lora_spec(lora, conf["model_type"])
    if vocab_size is not None and conf["vocab_size"] < vocab_size:
        # A token id past the embedding table would fail at the first rare token, long after start-up.
        where = f"{m.where}.path {m.path!r}" if m.path else f"{m.where}.hf_config"
        raise UserError(
            f"{where} has vocab_size={conf['vocab_size']}, smaller than the data tokenizer's {vocab_size} tokens; accepted: "
            "the model's own tokenizer (data.tokenizer=<model dir>) or a model with a vocabulary at least that large"
        )
    return HFSpec(_canonical_json(conf), path=m.path, **common)


def saved_spec(saved_model: dict[str, Any]) -> ModelSpec:
    """The spec a checkpoint's trainer.json "model" entry (spec.config()) describes. Its
    weights come from the checkpoint, so a Hugging Face model needs no directory."""
    fields = dict(saved_model)
    fields.pop(PROJECTION, None)  # distillation's projection: the student's own model has none
    lora = fields.pop("lora", None)
    adapters = LoraSpec(lora["r"], lora["alpha"], lora["dropout"], tuple(lora["target_modules"])) if lora else None
    if fields.get("source") == "python":  # imported again, with the arguments it was built with
        return with_source(
            from_import(fields["spec"], fields["spec_args"], fields["vocab_size"]), fields["spec"], fields["spec_args"]
        )
    if fields.get("source") == "hf":
        return HFSpec(_canonical_json(fields["hf_config"]), lora=adapters)
    return LlamaSpec(ModelShape(**fields), lora=adapters)


def _canonical_json(conf: dict[str, Any]) -> str:
    return json.dumps(conf, sort_keys=True, default=str)
