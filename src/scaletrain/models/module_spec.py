"""A model of your own: any torch.nn.Module that maps token ids [batch, seq] to logits
[batch, seq, vocab] (or an output holding `.logits`), trained by every engine that needs no
more than the core ModelSpec (ddp, fsdp, zero1-3 with offload).

    # my_models/gpt.py
    from scaletrain import ModuleSpec

    def make_spec(vocab_size, dim=256, layers=4):
        return ModuleSpec(lambda: GPT(vocab_size, dim, layers), vocab_size=vocab_size, blocks="blocks")

    # config.yaml
    model: {source: python, spec: "my_models.gpt:make_spec", spec_args: {dim: 256}}

The config names the builder by an import string, because every rank reads the config and
imports it (torchtitan's custom imports work the same way), and so does a resume, `eval` and
`ckpt convert`/`export` later: the string and its arguments go into trainer.json. What the
spec does not say is found or defaulted:

- blocks: the repeated units the engines wrap, checkpoint and shard. An attribute path
  ("transformer.h"), a function of the model, or None: the longest ModuleList.
- init: `init(model, seed)` on the materialized (perhaps sharded) model; default: each
  parameter from its own (seed, name) stream (biases 0, norms 1, the rest normal(0, 0.02)),
  the same numbers on any layout. A model with buffers needs an init that fills them.
- loss: `loss(output, targets)`; default: the mean next-token cross entropy of the logits,
  chunked with train.loss_chunk_tokens.
- the planner's figures: parameter counts from the meta-device build, FLOPs as 6 x the
  parameters of its matmuls per token (`flops_per_token=` says more, e.g. attention), its
  activations traced through the first block's call (models/capture.py) and the head
  (`head=`: attribute path or function giving final norm + output projection; default: the
  last norm outside the blocks and the last Linear onto the vocabulary).

Tensor, pipeline, context and expert parallel need more than a module: a spec offers them
with objects that have their methods (models/capabilities.py), `ModuleSpec(...,
offers=[MyTensorParallel()])` (examples/gpt2/gpt2.py offers a tensor-parallel plan of its
feed-forward so); what it does not offer is refused in one line where it is asked for."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.capabilities import ContextChunks, ExpertSplit, PipelineStages, TensorParallel
from scaletrain.models.capture import first_call
from scaletrain.models.counts import ModelCounts, counts_of
from scaletrain.models.loss import cross_entropy, logits_of
from scaletrain.models.params import freeze_all_but, seeded_init

INIT_STD = 0.02
CAPABILITIES = (TensorParallel, PipelineStages, ContextChunks, ExpertSplit)
Part = str | Callable[[nn.Module], nn.Module] | None


def ModuleSpec(  # noqa: N802  (a constructor, named as the thing it makes)
    build: Callable[[], nn.Module],
    *,
    vocab_size: int,
    blocks: Part = None,
    init: Callable[[nn.Module, int], None] | None = None,
    loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    head: Part = None,
    flops_per_token: Callable[[int], float] | None = None,
    name: str = "module",
    offers: Iterable[Any] = (),
) -> PythonSpec:
    """The spec of the module `build()` returns (see the module's text)."""
    if not callable(build):
        raise UserError(f"ModuleSpec's build is {type(build).__name__}; accepted: a function returning an nn.Module")
    offers = tuple(offers)
    for o in offers:
        if not any(isinstance(o, cap) for cap in CAPABILITIES):
            raise UserError(
                f"ModuleSpec's offers holds a {type(o).__name__}, which has the methods of no capability; accepted: objects "
                "with check_tp and apply_tp, check_pp, pipeline_stage and stage_costs, apply_cp, or check_ep and "
                "split_experts (scaletrain.TensorParallel, PipelineStages, ContextChunks, ExpertSplit)"
            )
    return PythonSpec(build, vocab_size, blocks, init, loss, head, flops_per_token, name, offers=offers)


@dataclass(frozen=True)
class PythonSpec:
    """What ModuleSpec makes; the factory adds the run's fields (models/factory.py)."""

    build: Callable[[], nn.Module]
    vocab_size: int
    blocks_at: Part = None
    init: Callable[[nn.Module, int], None] | None = None
    loss_of: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    head_at: Part = None
    flops: Callable[[int], float] | None = None
    name: str = "module"
    # Objects with a capability's methods (models/capabilities.py): what the spec offers
    # beyond a module, e.g. a tensor-parallel plan (check_tp and apply_tp).
    offers: tuple[Any, ...] = ()
    # Set from the config: the import string and its arguments (what trainer.json records).
    source: str | None = None
    spec_args: str = "{}"  # JSON, sorted: hashable
    loss_chunk_tokens: int = 0
    loss_compiled: bool = False
    trainable: tuple[str, ...] = ()
    digest: str = ""  # a hash of the builder's source file, for the planner's trace cache

    def __repr__(self) -> str:
        # The planner's trace cache keys on repr (planning/trace_cache.py): an edited model file changes it.
        at = self.source or f"{getattr(self.build, '__module__', '?')}.{getattr(self.build, '__qualname__', '?')}"
        offers = ", ".join(type(o).__name__ for o in self.offers)
        return (
            f"PythonSpec({at}, {self.spec_args}, vocab={self.vocab_size}, chunk={self.loss_chunk_tokens}, {self.digest}"
            f"{', offers ' + offers if offers else ''})"
        )

    @cached_property
    def _shape(self) -> tuple[int, int]:
        """(hidden size, blocks), from one meta-device build."""
        model = self._meta()
        blocks = self.blocks(model)
        embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding) and m.num_embeddings == self.vocab_size]
        if not embeddings:
            raise UserError(
                f"model.spec {self.source or self.name}: no nn.Embedding of {self.vocab_size} tokens (vocab_size); "
                "accepted: a module whose token embedding is an nn.Embedding(vocab_size, width)"
            )
        return embeddings[0].embedding_dim, len(list(blocks.children()))

    @property
    def hidden_size(self) -> int:
        return self._shape[0]

    @property
    def n_blocks(self) -> int:
        return self._shape[1]

    def _meta(self) -> nn.Module:
        with torch.device("meta"):
            model = self.build()
        if not isinstance(model, nn.Module):
            raise UserError(
                f"model.spec {self.source or self.name}: build() returned {type(model).__name__}; accepted: an nn.Module"
            )
        return model

    def build_meta(self, max_seq_len: int) -> nn.Module:
        model = self._meta()
        freeze_all_but(model, self.trainable)
        return model

    def blocks(self, model: nn.Module) -> nn.Module:
        found = _part(model, self.blocks_at) if self.blocks_at is not None else _longest_list(model)
        if found is None or not list(found.children()):
            raise UserError(
                f"model.spec {self.source or self.name}: no repeated blocks found ({self.blocks_at or 'no nn.ModuleList'}); "
                "accepted: ModuleSpec(..., blocks='attribute.path') naming the ModuleList of its blocks"
            )
        return found

    def materialize(self, model: nn.Module, device: torch.device, seed: int) -> None:
        tied = _tied(model)
        model.to_empty(device=device)
        for alias, owner in tied:  # to_empty gives each name of a shared weight its own storage
            _set(model, alias, _get(model, owner))
        if self.init is not None:
            self.init(model, seed)
            return
        if buffers := [n for n, _ in model.named_buffers()]:
            raise UserError(
                f"model.spec {self.source or self.name}: buffers {buffers[:3]} have no values after the meta-device build; "
                "accepted: ModuleSpec(..., init=fn) where fn(model, seed) fills them, or a module without buffers"
            )
        seeded_init(model, seed, INIT_STD)

    def loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.loss_of is not None:
            return self.loss_of(output, targets)
        return cross_entropy(logits_of(output), targets, self.loss_chunk_tokens, self.loss_compiled)

    def config(self) -> dict[str, Any]:
        if self.source is None:
            raise UserError(
                f"the model {self.name} was given as a spec object, which a checkpoint cannot name; accepted: "
                "model.source=python with model.spec='package.module:function' (and model.spec_args)"
            )
        return {"source": "python", "spec": self.source, "spec_args": json.loads(self.spec_args), "vocab_size": self.vocab_size}

    def counts(self) -> ModelCounts:
        return counts_of(self)

    def flops_per_token(self, seq_len: int) -> float:
        return float(self.flops(seq_len)) if self.flops is not None else float(6 * self.counts().matmul)

    # The planner's trace (models/capabilities.py, Traceable): the first block as the model calls it.
    def traced_block(self, seq_len: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        model = self.build()  # under the planner's FakeTensorMode: nothing allocated
        return first_call(model, next(self.blocks(model).children()), seq_len), ()

    def traced_head(self) -> nn.Module:
        model = self.build()
        if self.head_at is not None:
            return _part(model, self.head_at)
        inside = {id(m) for m in self.blocks(model).modules()}
        outside = [m for m in model.modules() if id(m) not in inside]
        norms = [m for m in outside if "norm" in type(m).__name__.lower()]
        heads = [m for m in outside if isinstance(m, nn.Linear) and m.out_features == self.vocab_size]
        if not heads:
            raise UserError(
                f"model.spec {self.source or self.name}: the planner finds no nn.Linear onto the {self.vocab_size}-token "
                "vocabulary outside the blocks; accepted: ModuleSpec(..., head='attribute' or a function of the model)"
            )
        return nn.Sequential(norms[-1], heads[-1]) if norms else heads[-1]


def from_import(spec: str, args: dict[str, Any], vocab_size: int | None, where: str = "model") -> PythonSpec:
    """The spec `package.module:function` returns, called with `args` (and vocab_size, the
    tokenizer's, unless args give one); one line for each way that can fail."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(
            f"{where}.spec={spec!r}: cannot import {module_name} ({e}); accepted: a module on every rank's PYTHONPATH"
        ) from None
    except SyntaxError as e:  # the module's own code: where, and what Python said
        raise UserError(
            f"{where}.spec={spec!r}: {e.filename}, line {e.lineno}: {e.msg}; accepted: a module Python can import"
        ) from None
    make = getattr(module, attr, None)
    if not callable(make) and module_name == "__main__":  # train(config, spec=fn) with fn defined in the script
        raise UserError(
            f"{where}.spec={spec!r} names a function of the script that trained the model, which this program does not "
            "define; accepted: that script (scaletrain.evaluate from it), or the function in a module on PYTHONPATH "
            "when training (docs/api.md)"
        )
    if not callable(make):
        raise UserError(f"{where}.spec={spec!r}: {module_name} has no function {attr!r}; accepted: 'package.module:function'")
    kwargs = dict(args)
    if "vocab_size" not in kwargs:
        if vocab_size is None:
            raise UserError(
                f"{where}.spec={spec!r} needs a vocabulary size and there is no tokenizer to take it from (plan); "
                f"accepted: {where}.spec_args.vocab_size=N"
            )
        kwargs["vocab_size"] = vocab_size
    try:
        made = make(**kwargs)
    except TypeError as e:
        raise UserError(f"{where}.spec={spec!r} called with {sorted(kwargs)}: {e}; accepted: its own parameters") from None
    if not isinstance(made, PythonSpec):
        raise UserError(f"{where}.spec={spec!r} returned {type(made).__name__}; accepted: scaletrain.ModuleSpec(...)")
    return made


def import_string(make: Any) -> str:
    """The `module:function` that from_import finds `make` by (what `train(config, spec=make)`
    puts in model.spec): a function at the top level of its module, the script's own
    (`__main__`) included; one line for anything an import string cannot name."""
    if isinstance(make, PythonSpec):
        raise UserError(
            "spec= is a ModuleSpec(...) itself, which a checkpoint cannot name; accepted: the function that returns it, "
            "defined at the top level of a module (train(config, spec=make_spec))"
        )
    if isinstance(make, str):
        raise UserError(
            f"spec={make!r} is a string; accepted: the function itself (spec=make_spec), or the string as model.spec "
            "with model.source=python"
        )
    module, qualname = getattr(make, "__module__", None), getattr(make, "__qualname__", None)
    if not callable(make) or not isinstance(module, str) or not isinstance(qualname, str):
        raise UserError(
            f"spec= is of type {type(make).__name__}, not a function an import string can name; accepted: a function defined "
            "at the top level of a module, returning scaletrain.ModuleSpec(...)"
        )
    at = f"{module}.{qualname}"
    if not qualname.isidentifier():
        what = "a lambda or a function defined inside another" if "<" in qualname else "not at its module's top level"
        raise UserError(
            f"spec={at} is {what}: no import string names it, and a checkpoint must rebuild its model from one; "
            "accepted: a function defined at the top level of a module (or of the script)"
        )
    if getattr(sys.modules.get(module), qualname, None) is not make:
        raise UserError(
            f"spec={at} is not the function {module}.{qualname} names now, which a resume would import; accepted: "
            f"the function that {module}.{qualname} is"
        )
    return f"{module}:{qualname}"


def named(spec: str) -> Any:
    """What the import string `spec` names, or None where its module does not import or has no such name."""
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr, None)
    except (ImportError, ValueError, SyntaxError):  # ValueError: no module name at all; SyntaxError: said where it is built
        return None


def with_source(spec: PythonSpec, source: str, args: dict[str, Any], **fields: Any) -> PythonSpec:
    """`spec` with where it came from, its arguments and the run's fields (models/factory.py)."""
    return replace(spec, source=source, spec_args=json.dumps(args, sort_keys=True), digest=_digest(spec.build), **fields)


def _digest(fn: Callable[..., Any]) -> str:
    try:
        path = inspect.getsourcefile(fn)
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16] if path else ""
    except (OSError, TypeError):
        return ""


def _part(model: nn.Module, at: Part) -> nn.Module:
    if callable(at):
        return at(model)
    found: Any = model
    for name in str(at).split("."):
        found = getattr(found, name, None)
        if found is None:
            raise UserError(f"{type(model).__name__} has no {at!r}; accepted: an attribute path of the module, or a function")
    return found


def _longest_list(model: nn.Module) -> nn.Module | None:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    return max(lists, key=len) if lists else None


def _tied(model: nn.Module) -> list[tuple[str, str]]:
    """(alias, owner) for each parameter reachable under a second name."""
    first: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return out


def _get(model: nn.Module, name: str) -> nn.Parameter:
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner), attr)


def _set(model: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, param)


def from_section(m: Any, vocab_size: int | None, lora: Any, document_eos: int | None, common: dict[str, Any]) -> PythonSpec:
    """model.source=python (config/sources.py): the spec the import string's function returns."""
    del lora, document_eos  # the config refuses both for a model of your own
    return with_source(from_import(m.spec, m.spec_args, vocab_size, m.where), m.spec, m.spec_args, **common)


def from_saved(fields: dict[str, Any], adapters: Any) -> PythonSpec:
    """A checkpoint's model of your own: imported again, with the arguments it was built with."""
    del adapters
    return with_source(
        from_import(fields["spec"], fields["spec_args"], fields["vocab_size"]), fields["spec"], fields["spec_args"]
    )
