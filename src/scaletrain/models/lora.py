"""LoRA through peft (`model.lora`), on the built-in model and Hugging Face models alike.

peft's `inject_adapter_in_model` replaces each target Linear in place by its LoRA layer
(the original under `<module>.base_layer`, the adapters as `<module>.lora_A.default` and
`.lora_B.default`) and freezes everything else, on the meta-device model the spec builds:
so every engine sees a frozen base with small trainable adapters, exactly as for
`model.trainable`, and shards, checkpoints and reshards them like any parameter. No
PeftModel wrapper: parameter names stay the model's own plus peft's parts.

Initialization: the base as without LoRA (each weight seeded by its name without
`.base_layer`, so a LoRA run's base equals the plain run's), A as peft does (kaiming-
uniform, bound 1/sqrt(fan_in)) from its own seeded generator, B zero: the adapted model
starts equal to the base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.params import base_name, canonical_name, copy_full, is_adapter, name_generator
from scaletrain.models.torchao_noise import quiet_torchao

BUILTIN_TARGETS = ("wq", "wk", "wv", "wo")  # the built-in model's attention projections


@dataclass(frozen=True)
class LoraSpec:
    r: int
    alpha: int
    dropout: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.r  # peft's default (not rsLoRA)

    def as_dict(self) -> dict[str, Any]:
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout, "target_modules": list(self.targets)}


def lora_spec(cfg: Any, model_type: str | None) -> LoraSpec | None:
    """`model.lora` with its targets resolved: as given, else the built-in model's
    attention projections, else peft's default for the Hugging Face model_type."""
    if cfg is None:
        return None
    targets = tuple(cfg.target_modules or ())
    if not targets:
        if model_type is None:
            targets = BUILTIN_TARGETS
        else:
            with quiet_torchao():  # peft imports torchao where it is installed (models/torchao_noise.py)
                from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

            if model_type not in DEFAULTS:
                raise UserError(
                    f"model.lora has no target_modules and peft knows no default for model_type {model_type!r}; "
                    "accepted: model.lora.target_modules=[names of Linear modules, e.g. q_proj, v_proj]"
                )
            targets = tuple(DEFAULTS[model_type])
    return LoraSpec(cfg.r, cfg.alpha, cfg.dropout, targets)


def apply_lora(model: nn.Module, lora: LoraSpec) -> None:
    """Inject LoRA layers into the (meta-device) model in place; freezes all but the adapters."""
    try:
        with quiet_torchao():  # peft imports torchao where it is installed (models/torchao_noise.py)
            from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise UserError("model.lora needs the peft package; accepted: pip install 'scaletrain[lora]', or no model.lora") from None
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.targets))
    try:
        inject_adapter_in_model(config, model, low_cpu_mem_usage=True)
    except ValueError as e:  # e.g. a target that matches no module
        raise UserError(f"model.lora.target_modules {list(lora.targets)}: peft refused them ({str(e).splitlines()[0]})") from None


def trainable_patterns(trainable: tuple[str, ...], lora: LoraSpec | None) -> tuple[str, ...]:
    """model.trainable's patterns, plus the adapters under LoRA (which froze the rest already)."""
    return (*trainable, "*.lora_A.*", "*.lora_B.*") if lora is not None and trainable else trainable


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """A kaiming-uniform (bound 1/sqrt(fan_in), peft's), B zero; each A from its own generator."""
    for name, param in model.named_parameters():
        name = canonical_name(name)
        if ".lora_B." in name:
            copy_full(param, torch.zeros(param.shape))
        elif ".lora_A." in name:
            bound = 1.0 / math.sqrt(param.shape[1])
            copy_full(param, torch.empty(param.shape).uniform_(-bound, bound, generator=name_generator(seed, name)))


def merged_names(names: list[str]) -> dict[str, tuple[str, tuple[str, str] | None]]:
    """For a checkpoint's parameter names: each name of the merged model -> (the tensor it
    is read from, the (A, B) adapter pair folded into it or None). Adapters disappear."""
    out: dict[str, tuple[str, tuple[str, str] | None]] = {}
    for name in names:
        if is_adapter(name):
            continue
        pair = None
        if ".base_layer." in name and name.endswith(".weight"):
            module = name.rsplit(".base_layer.", 1)[0]
            pair = (f"{module}.lora_A.default.weight", f"{module}.lora_B.default.weight")
        out[base_name(name)] = (name, pair)
    return out


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, lora: LoraSpec) -> torch.Tensor:
    """W + scaling * B @ A, in fp32 (what peft's merge computes)."""
    return weight.float() + lora.scaling * (b.float() @ a.float())
