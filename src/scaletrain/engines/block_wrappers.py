"""Per-block wrappers shared by the torch engines: activation checkpointing, torch.compile."""

from __future__ import annotations

import os

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    checkpoint_wrapper,
)


def apply_activation_checkpointing(blocks: nn.Module) -> None:
    """Recompute each block's forward during backward instead of keeping its activations.

    Apply before any sharding so a recomputed forward goes through the engine's hooks
    again. The wrapper adds `_checkpoint_wrapped_module` to parameter names; init and
    get_state_dict both strip it, so checkpoints keep plain names.
    """
    for name, block in list(blocks.named_children()):  # a ModuleList's or a ModuleDict's
        setattr(blocks, name, checkpoint_wrapper(block))


def plain_name(name: str) -> str:
    """A parameter name without the wrapper's part, as in an unwrapped model.

    torch's get_state_dict strips it already; DeepSpeed's own state readers do not.
    """
    return name.replace(_CHECKPOINT_PREFIX, "")


def compile_blocks(blocks: nn.Module) -> None:
    """torch.compile each block in place, after activation checkpointing and before any
    sharding (torchtitan's order: the compiled graph includes the recompute, and FSDP's
    hooks stay outside it). `nn.Module.compile` compiles the forward only: the module keeps
    its class and parameter names, so checkpoints and engines see the same model. Every
    block runs the same code, so dynamo compiles it once (modules are graph inputs) and the
    other blocks reuse it. Compilation happens at the first step."""
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        # Inductor picks its CPU vector width from the CPU, not from ATen's capability: with
        # ATen's portable kernels forced, its vectorized C++ does not compile ("'at::vec'
        # has not been declared", torch 2.13). Scalar code compiles and computes the same.
        import torch._inductor.config as inductor

        inductor.cpp.simdlen = 1
    for block in blocks.children():
        block.compile()
