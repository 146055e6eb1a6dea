"""The model sources (model.source) as a registry: one entry each, carrying what the config's
checks and the model factory ask of it.

Torch-free data, here beside the presets (config/presets.py) because the config validates a
model section against it; the specs themselves are built by the functions an entry names
("module:function", imported by models/factory.py): `from_section(section, vocab_size, lora,
document_eos, common)` for a run's config, `from_saved(fields, adapters)` for a checkpoint's
trainer.json. Adding a source is one module with those two functions and one entry below
(docs/architecture.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The built-in model's shape fields: each overrides its preset when set.
SHAPE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings", "rope_theta", "moe")


@dataclass(frozen=True)
class Source:
    name: str
    about: str  # how messages name its models: "Hugging Face models"
    keys: tuple[str, ...]  # the section's keys that belong to it alone
    # Where it takes what another source's keys would say (for the refusal), or "".
    instead: str
    check: Callable[[Any, str], str | None]  # its own checks of the section (at: its key path)
    module: str  # the module with its from_section and from_saved
    # What the config's checks ask of it:
    lora: bool  # model.lora: peft adapters on its known layers
    document_mask: bool  # data.document_mask: the model takes the documents' mask and positions
    cp_modes: tuple[str, ...]  # parallel.cp_mode values its attention takes
    float8: bool  # train.float8: which Linear is a router is known
    tiles: bool  # train.tile_tokens: its feed-forward, experts and loss tile
    experts: str  # "section": model.moe or an MoE preset; "spec": its spec says at build; "": none
    # Whether the section fixes the vocabulary (else the planner plans the tokenizer's the run
    # would train), and how banners name the model (the section, the built spec).
    knows_vocab: Callable[[Any], bool]
    label: Callable[[Any, Any], str]


def _builtin(m: Any, at: str) -> str | None:
    return None


def _hf(m: Any, at: str) -> str | None:
    if (m.path is None) == (m.hf_config is None):
        return f"{at}.source=hf needs exactly one of {at}.path (a local directory) or {at}.hf_config (an inline config)"
    if m.hf_config is not None and "model_type" not in m.hf_config:
        return f"{at}.hf_config has no model_type; accepted: e.g. {{model_type: llama, hidden_size: 64, ...}}"
    return None


def _python(m: Any, at: str) -> str | None:
    if m.spec is None or not re.fullmatch(r"[\w.]+:[\w]+", m.spec):
        return (
            f"{at}.source=python needs {at}.spec as 'package.module:function' (got {m.spec!r}); accepted: e.g. "
            f"{at}.spec=my_models.gpt:make_spec"
        )
    return None


def _builtin_vocab(m: Any) -> bool:
    from scaletrain.config.presets import PRESETS

    return m.vocab_size is not None or PRESETS[m.preset]["vocab_size"] is not None


def _hf_vocab(m: Any) -> bool:
    return m.path is not None or "vocab_size" in (m.hf_config or {})


def _python_vocab(m: Any) -> bool:
    return "vocab_size" in m.spec_args


def _builtin_label(m: Any, spec: Any) -> str:
    return str(m.preset)


def _hf_label(m: Any, spec: Any) -> str:
    return f"{spec.model_type} (Hugging Face, {m.path or 'inline config'})"


def _python_label(m: Any, spec: Any) -> str:
    return f"{spec.name} ({m.spec})"


SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source(
            "builtin", "the built-in model", SHAPE_FIELDS, "", _builtin, "scaletrain.models.spec",
            lora=True, document_mask=True, cp_modes=("allgather", "ulysses"), float8=True, tiles=True, experts="section",
            knows_vocab=_builtin_vocab, label=_builtin_label,
        ),
        Source(
            "hf", "Hugging Face models", ("path", "hf_config"), "its config's fields in {at}.hf_config", _hf,
            "scaletrain.models.hf",
            lora=True, document_mask=False, cp_modes=("ulysses",), float8=False, tiles=False, experts="spec",
            knows_vocab=_hf_vocab, label=_hf_label,
        ),
        Source(
            "python", "a model of your own", ("spec", "spec_args"), "its arguments in {at}.spec_args", _python,
            "scaletrain.models.module_spec",
            lora=False, document_mask=False, cp_modes=(), float8=False, tiles=False, experts="",
            knows_vocab=_python_vocab, label=_python_label,
        ),
    )
}  # fmt: skip


def source_problem(m: Any, at: str) -> str | None:
    """What in model section `m` (at: its key path) does not go with its model.source: the
    source's own checks, then a key that belongs to another source. None if nothing."""
    entry = SOURCES[m.source]
    problem = entry.check(m, at)
    if problem:
        return problem
    for other in SOURCES.values():
        if other is entry:
            continue
        for key in other.keys:
            value = getattr(m, key)
            if value is None or value == {}:  # unset (spec_args' default is empty)
                continue
            if entry.instead:
                return (
                    f"{at}.{key} does not apply to {entry.about}; accepted: {entry.instead.format(at=at)}, or "
                    f"{at}.source={other.name} with it"
                )
            return f"{at}.{key} is for {other.about}; accepted: {at}.source={other.name} with it, or no {at}.{key}"
    return None
