"""Per-block wrappers shared by the torch engines: activation checkpointing, torch.compile."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    checkpoint_wrapper,
)

from scaletrain.models import selective_ac
from scaletrain.models.inductor import portable_cpu_code


def apply_activation_checkpointing(blocks: nn.Module, selective: bool = False) -> None:
    """Recompute each block's forward during backward instead of keeping its activations;
    `selective` (parallel.ac_mode=selective): only what models/selective_ac.py does not keep.

    Apply before any sharding so a recomputed forward goes through the engine's hooks
    again. The wrapper adds `_checkpoint_wrapped_module` to parameter names; init and
    get_state_dict both strip it, so checkpoints keep plain names.
    """
    for name, block in list(blocks.named_children()):  # a ModuleList's or a ModuleDict's
        wrapped = checkpoint_wrapper(block, context_fn=selective_ac.context) if selective else checkpoint_wrapper(block)
        setattr(blocks, name, wrapped)


def plain_name(name: str) -> str:
    """A parameter name without the wrapper's part, as in an unwrapped model.

    torch's get_state_dict strips it already; DeepSpeed's own state readers do not.
    """
    return name.replace(_CHECKPOINT_PREFIX, "")


# torch.compile's backend for the blocks. A test that checks dynamo's decisions (graphs,
# breaks, recompilations: the same under any backend) may take aot_eager, which skips
# inductor's C++ compilation (tens of seconds per graph on a 2-core CPU).
BACKEND = "inductor"
# At most 2 kinds of block x 2 grad modes x 16 micro-batch shapes (see compile_blocks).
RECOMPILE_LIMIT = 64


def compile_blocks(blocks: nn.Module) -> None:
    """torch.compile each block in place, after activation checkpointing and before any
    sharding (torchtitan's order: the compiled graph includes the recompute, and FSDP's
    hooks stay outside it). `nn.Module.compile` compiles the forward only: the module keeps
    its class and parameter names, so checkpoints and engines see the same model. Every
    block runs the same code, so dynamo compiles it once (modules are graph inputs) and the
    other blocks reuse it. Compilation happens at the first step.

    fullgraph (the built-in blocks): a graph break is an error here, not a silent split
    into smaller graphs with eager Python between them. dynamic=False: a block sees one micro-batch shape per
    run (RankBatches), so its graph is specialized to it; a new shape (an evaluation's
    shorter last micro-batch, a micro-batch halved after an out-of-memory error) compiles
    one more static graph instead of turning every later graph dynamic (docs/engines.md)."""
    from scaletrain.models.moe import moe_layers

    for layer in moe_layers(blocks):
        _check_compilable(layer.experts)
    import torch._dynamo

    # Every compiled block runs nn.Module._call_impl, one code object whose graphs dynamo
    # counts against one limit: each kind of block (dense, mixture of experts) x grad mode
    # (training, evaluation) x micro-batch shape (an evaluation's shorter last one, each
    # halving after an out-of-memory error). Under fullgraph=True, going past torch's
    # default of 8 is a hard failure mid-run (FailOnRecompileLimitHit), not a slowdown.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    portable_cpu_code()
    for block in blocks.children():
        block.compile(backend=BACKEND, fullgraph=_built_in(block), dynamic=False)


def _built_in(block: nn.Module) -> bool:
    """Whether `block` (or the one a checkpoint wrapper holds) is scaletrain's own, which
    compiles whole. A Hugging Face model's layer may not: transformers 5.23's output-
    capturing hooks (a Mixtral's router logits) read a ContextVar, which dynamo cannot
    trace, so it breaks the graph there, as before; compile_counters shows the breaks."""
    from scaletrain.models.llama import TransformerBlock

    return isinstance(getattr(block, "_checkpoint_wrapped_module", block), TransformerBlock)


def _check_compilable(experts: nn.Module) -> None:
    """A compiled mixture of experts runs its experts as torch._grouped_mm (the loop reads
    its split sizes on the host, a graph break; the config refuses experts_impl=loop with
    train.compile); one UserError where that cannot be."""
    from scaletrain.errors import UserError

    if not hasattr(torch, "_grouped_mm"):
        raise UserError(
            f"train.compile=true with a mixture of experts needs torch._grouped_mm, which torch {torch.__version__} lacks; "
            "accepted: train.compile=false"
        )
    dim, hidden = experts.get_parameter("w1").shape[-2:]
    if dim % 8 or hidden % 8:  # 16 bytes of bf16; fp32 would take 4, but the dtype is not known yet
        raise UserError(
            f"train.compile=true with a mixture of experts runs them as torch._grouped_mm, which takes rows of a multiple "
            f"of 16 bytes: model.dim={dim} and the expert width {hidden} (model.moe.expert_ffn_dim) must be multiples of 8; "
            "accepted: such widths, or train.compile=false"
        )
