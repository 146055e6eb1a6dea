"""What a model may offer beyond the core ModelSpec (models/spec.py): a layout or a tool that
needs more than building, blocks, materializing and a loss asks for it here, and this is the
one place a missing capability is refused, in one line naming it and the key that needs it.

The built-in Llama offers all of them, a Hugging Face model the planner's trace (its other
answers are refusals with their reasons), a model of your own (model.source: python,
models/module_spec.py) whatever its spec offers: a spec is a capability's as soon as it has
the capability's methods, or offers an object that has them (ModuleSpec(..., offers=[...]));
scaletrain exports the protocols (scaletrain.TensorParallel, ...) for such objects' types."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from scaletrain.errors import UserError


@runtime_checkable
class TensorParallel(Protocol):
    def check_tp(self, tp: int) -> None:
        """A one-line UserError unless the model splits evenly over `tp` ranks."""

    def apply_tp(self, model: nn.Module, mesh: Any, sequence_parallel: bool, loss_parallel: bool) -> None:
        """Split the (meta-device) model over the 1-D tensor-parallel `mesh` in place, before FSDP."""


@runtime_checkable
class PipelineStages(Protocol):
    def check_pp(self, pp: int) -> None:
        """A one-line UserError unless the model can be cut into pipeline stages."""

    def pipeline_stage(self, model: nn.Module, blocks: range, first: bool, last: bool) -> None:
        """Cut the (meta-device) model down to one stage in place: `blocks`, the input
        embedding if `first`, the head if `last`; parameter names stay the whole model's."""

    def stage_costs(self, seq_len: int) -> tuple[float, float, float]:
        """Training FLOPs per token of (the embedding, one block, the final norm and head):
        what the pipeline split and the planner balance stages by."""


@runtime_checkable
class ContextChunks(Protocol):
    def apply_cp(self, model: nn.Module, cp: Any) -> None:
        """Have the model hold only this rank's chunks of each sequence (a ContextParallel,
        models/context_parallel.py); a one-line UserError where it cannot."""


@runtime_checkable
class ExpertSplit(Protocol):
    def check_ep(self, ep: int) -> None:
        """A one-line UserError unless the model's experts split evenly over `ep` ranks."""

    def split_experts(self, model: nn.Module, ep_mesh: Any) -> list[nn.Module]:
        """Split the (meta-device) model's stacked experts over the 1-D `ep_mesh` in place
        (Shard(0) DTensors), each layer then sending its token slots to their experts' ranks
        and back; returns the expert modules, which FSDP shards on their own."""


@runtime_checkable
class Traceable(Protocol):
    def traced_block(self, seq_len: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        """A fresh block and the extra inputs it takes after the hidden states (the planner
        builds it under FakeTensorMode and traces what it saves for backward)."""

    def traced_head(self) -> nn.Module:
        """Final norm + output projection: hidden states -> logits, for the same tracing."""


# What each is, and the methods a spec defines to offer it (for the refusal's line).
_WHAT = {
    TensorParallel: ("a tensor-parallel plan", "check_tp and apply_tp"),
    PipelineStages: ("pipeline stages", "check_pp, pipeline_stage and stage_costs"),
    ContextChunks: ("context-parallel attention", "apply_cp"),
    ExpertSplit: ("experts to split", "check_ep and split_experts"),
    Traceable: ("the planner's trace of a block and the head", "traced_block and traced_head"),
}
C = TypeVar("C")


def offered(spec: Any, cap: type[C]) -> C | None:
    """`spec` as `cap`: the spec itself where it has the methods, else the first of its
    `offers` that has them (a model of your own: ModuleSpec(..., offers=[...]),
    models/module_spec.py); None where neither does."""
    if isinstance(spec, cap):
        return spec
    return next((o for o in getattr(spec, "offers", ()) if isinstance(o, cap)), None)


def capability(spec: Any, cap: type[C], key: str, accepted: str) -> C:
    """`spec` as `cap` (offered), or the one-line refusal: `key` (e.g. "parallel.tp=2") needs
    what `cap` is, which this model does not offer; `accepted`: what would do instead."""
    found = offered(spec, cap)
    if found is not None:
        return found
    what, methods = _WHAT[cap]
    raise UserError(
        f"{key} needs {what}, which the model {describe(spec)} does not offer (its spec has no {methods}, nor offers an "
        f"object that has them); accepted: {accepted}"
    )


def check_layout(spec: Any, parallel: Any) -> None:
    """Every capability the layout (`parallel`, the config's section) asks of the model, on
    every rank before anything is planned or built: a refusal on one rank only (the planner
    runs on rank 0) would leave the others waiting for it."""
    for size, cap, key in (
        (parallel.tp, TensorParallel, "tp"),
        (parallel.pp, PipelineStages, "pp"),
        (parallel.cp, ContextChunks, "cp"),
        (parallel.ep, ExpertSplit, "ep"),
    ):
        if size > 1:
            capability(spec, cap, f"parallel.{key}={size}", f"parallel.{key}=1")


def describe(spec: Any) -> str:
    """How a spec is named in messages: its import string for a model of your own."""
    return str(getattr(spec, "source", None) or spec.name)
