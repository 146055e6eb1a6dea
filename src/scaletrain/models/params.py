"""Parameter names and the per-parameter seeded init that every model family shares.

A parameter is known by its canonical name: the model's own, without the parts engines
insert (activation checkpointing, FSDP1, torch.compile) and, for a LoRA base weight,
without peft's `.base_layer`. Its initial value is a pure function of (seed, that name),
so every rank, device and sharding layout gets the same numbers.
"""

from __future__ import annotations

import fnmatch
import zlib

import torch
from torch import nn

from scaletrain.errors import UserError

# Wrappers that engines insert into parameter names (activation checkpointing, FSDP1,
# torch.compile); dropped so that a wrapped model initializes exactly like a bare one.
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"})
ADAPTER_PARTS = (".lora_A.", ".lora_B.")  # peft's LoRA adapters (models/lora.py)
PROJECTION = "distill_proj"  # distillation's trained map to the teacher's width (models/distill.py)


def canonical_name(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def is_adapter(name: str) -> bool:
    return any(part in name for part in ADAPTER_PARTS)


def base_name(name: str) -> str:
    """A parameter's name in the model without LoRA."""
    return name.replace(".base_layer.", ".")


def name_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator of one parameter: its values depend on the run seed and its name
    only, never on the device, the visiting order or the sharding."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(param_seed(seed, name))
    return gen


def param_seed(seed: int, name: str) -> int:
    # torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, so the run seed
    # cannot sit in the high bits; it becomes the CRC's starting value instead. For one name,
    # that map is a bijection, so distinct seeds below 2**32 always give distinct streams.
    return zlib.crc32(name.encode(), zlib.crc32((seed & 0xFFFF_FFFF).to_bytes(4, "little")))


def copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-size CPU tensor into `param`, which may be a sharded DTensor (FSDP2)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # Every rank generated the same full tensor, so each keeps its own shard:
        # src_data_rank=None means no communication.
        local_device = param.to_local().device
        sharded = distribute_tensor(full.to(local_device), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(sharded.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def seeded_init(model: nn.Module, seed: int, std: float) -> None:
    """Every parameter from its own (seed, name) stream: biases 0, a norm's weights 1, the rest
    normal(0, std). The default of a Hugging Face model without weights and of a model of your
    own (models/module_spec.py): the same numbers on any layout, as the built-in model's."""
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    for name, param in model.named_parameters():
        name = base_name(canonical_name(name))  # a LoRA base weight is seeded as without LoRA
        owner = type(owners[id(param)]).__name__
        if is_adapter(name):
            continue  # lora.init_adapters
        if name.endswith("bias"):
            full = torch.zeros(param.shape)
        elif "Norm" in owner or "norm" in owner:
            full = torch.ones(param.shape)
        else:
            full = torch.empty(param.shape).normal_(0.0, std, generator=name_generator(seed, name))
        copy_full(param, full)


def freeze_all_but(model: nn.Module, patterns: tuple[str, ...]) -> None:
    """Turn requires_grad off for every parameter no pattern matches (none: all train).
    A weight shared under several names (a tied head) trains if any of its names match.
    A pattern that matches nothing is a one-line UserError naming some real names."""
    if not patterns:
        return
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    every = [n for group in names.values() for n in group]
    unmatched = [pat for pat in patterns if not any(fnmatch.fnmatchcase(n, pat) for n in every)]
    if unmatched:
        raise UserError(
            f"model.trainable pattern {unmatched[0]!r} matches no parameter; accepted: glob patterns over names such as "
            f"{', '.join(repr(n) for n in (every[0], every[1], every[-1]))} (e.g. 'layers.*.attention.*')"
        )
    for p in model.parameters():
        p.requires_grad_(any(fnmatch.fnmatchcase(n, pat) for n in names[id(p)] for pat in patterns))


# train.optimizer=muon (optim/muon.py): the output heads stay on AdamW (plain names: the
# built-in model's, Hugging Face's), and so does every embedding table (nn.Embedding:
# tokens, GPT-2's positions); here because the planner counts them too (models/counts.py).
MUON_EXCLUDED_HEADS = ("output.weight", "*lm_head.weight")
# A mixture of experts' stacked experts ([experts, rows, columns]) are a batch of matrices,
# each orthogonalised on its own; other 3-D weights (a convolution's) are not matrices.
MUON_STACKS = ("*.experts.*",)


def embedding_tables(model: nn.Module) -> set[int]:
    """The ids of the model's embedding tables (any wrapper's modules included)."""
    return {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}


def on_muon(name: str, param: torch.Tensor, tables: set[int]) -> bool:
    """Whether Muon steps this (trainable) parameter: a 2-D matrix that is no embedding table
    (`tables`: embedding_tables) and no output head, or a stack of experts' matrices."""
    if param.ndim == 3:
        return any(fnmatch.fnmatchcase(name, p) for p in MUON_STACKS)
    return param.ndim == 2 and id(param) not in tables and not any(fnmatch.fnmatchcase(name, p) for p in MUON_EXCLUDED_HEADS)
