"""Tensor parallelism for the built-in Llama: DTensor plans, applied before FSDP2.

Megatron's split, with torch's own styles (`torch.distributed.tensor.parallel`): in each
block wq/wk/wv and w1/w3 are column-parallel (each rank computes its own heads and its own
slice of the hidden FFN width), wo and w2 row-parallel (partial sums, reduced once per
sub-block). So each block costs two reductions in forward and two in backward, and
attention needs no communication at all: a rank's query heads and the kv heads they read
sit on the same rank, which is why n_heads and n_kv_heads must both divide by tp.

The embedding is split by vocabulary rows and the head by vocabulary columns (rows of its
[vocab, dim] weight): both are Shard(0) of the same matrix, so a tied embedding stays one
parameter. With loss parallel the logits stay split over the vocabulary and the cross
entropy reduces the per-shard softmax terms instead of gathering [tokens, vocab].

Sequence parallel: the norms and the residual stream between sub-blocks hold 1/tp of the
sequence (Shard(1)); the reductions become reduce-scatters and each sub-block starts with
an all-gather, the same bytes as the all-reduces, with 1/tp of the norm activations.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.presets import ModelShape

# DTensor's modules are imported where the split is applied: importing them pulls in sympy
# (~2 s of a core), which every process that plans paid for check_tp alone.
if TYPE_CHECKING:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import DeviceMesh


def check_tp(shape: ModelShape, tp: int) -> None:
    """A one-line UserError unless every split of the plan below is even."""
    if tp == 1:
        return
    splits = {
        "model.n_heads": shape.n_heads,
        "model.n_kv_heads": shape.n_kv_heads,
        "model.ffn_dim": shape.ffn_dim,
        "the vocabulary size": shape.vocab_size,
    }
    for what, n in splits.items():
        if n % tp:
            fits = [d for d in range(1, tp * 2 + 1) if all(v % d == 0 for v in splits.values())]
            closest = min(fits, key=lambda d: (abs(d - tp), -d))
            raise UserError(
                f"parallel.tp={tp} does not divide {what} ({n}): each rank must hold whole heads and equal slices; "
                f"closest valid layout: parallel.tp={closest}"
            )


class _Wait(torch.autograd.Function):
    """The collective's result as a plain tensor, waited for, its gradient passed through."""

    @staticmethod
    def forward(ctx: Any, x: AsyncCollectiveTensor) -> torch.Tensor:
        return x.trigger_wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _waited(module: nn.Module, args: Any, out: Any, waitable: type) -> Any:
    """The embedding's output, a plain tensor where it is still an AsyncCollectiveTensor (the
    reduction `to_local` left in flight). A compiled first block given that wrapper as its
    input returns no gradient for it (torch 2.13: the token embedding's gradient came back
    all zeros, the loss and every block's gradient right), so it leaves here waited."""
    return _Wait.apply(out) if isinstance(out, waitable) else out


def apply_tp(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Split `model` (a Llama, on the meta device or not) over the 1-D `mesh` in place."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    # A pipeline stage holds the embedding, the head and the final norm only if it is the
    # first or the last (the others are None there).
    embed, output, norm = model.tok_embeddings, model.output, model.norm
    tied = embed is not None and output is not None and output.weight is embed.weight  # type: ignore[union-attr]
    top: dict[str, Any] = {}
    if embed is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=seq,
            # Split over the vocabulary for the loss (DTensor), else gathered for plain use.
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if sequence_parallel and norm is not None:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    if isinstance(embed, nn.Module):
        # The class bound here, not imported by the hook: it runs every step.
        embed.register_forward_hook(functools.partial(_waited, waitable=AsyncCollectiveTensor))
    if tied:
        # parallelize_module gave each module a parameter of its own; both are Shard(0) of
        # the [vocab, dim] matrix, so one of them serves both again.
        model.output.weight = model.tok_embeddings.weight  # type: ignore[union-attr]
    for block in model.layers.children():  # type: ignore[union-attr]
        plan: dict[str, Any] = {
            # cos, sin and the document mask (data.document_mask; else None) are plain tensors, full length, on every rank.
            "attention": PrepareModuleInput(
                input_layouts=(seq, None, None, None), desired_input_layouts=(Replicate(), None, None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if getattr(block, "moe", False):
            # A mixture of experts stays whole on every tp rank and routes every token of the
            # micro-batch, as one process does: its balance terms count whole sequences, which
            # a rank's 1/tp of the sequence (sequence parallel) would not. Its output goes back
            # to the residual's layout; that redistribution's backward gathers the whole
            # gradient on every rank, so each rank's expert gradients are the whole ones
            # (FSDP reduces them over the data-parallel ranks only, like every weight).
            # Expert parallel splits the experts instead (engines/expert_parallel.py).
            for key in ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2"):
                del plan[key]
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(seq,),
                desired_input_layouts=(Replicate(),),
                output_layouts=(Replicate(), None, None),  # (output, aux, statistics)
                desired_output_layouts=(seq, Replicate(), Replicate()),  # read only where output_layouts has one
                use_local_input=True,  # the experts are plain tensors, not DTensors
                use_local_output=True,
            )
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, mesh, plan)
