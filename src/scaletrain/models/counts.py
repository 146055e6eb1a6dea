"""Parameter counts of any model spec, from its meta-device build: exact for every family
without a formula per family (the planner, FLOPs per token and run banners use them)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from scaletrain.models.params import embedding_tables, on_muon


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts of a model, from its meta-device instance."""

    total: int  # distinct parameters (a tied weight once)
    embedding: int  # token embedding tables
    output: int  # an untied output head (0 when tied to the embedding)
    non_embedding: int  # total - embedding - output: the blocks and norms
    matmul: int  # parameters multiplied per token: every Linear weight, a tied head included
    block: int  # parameters of the largest repeated block
    numels: tuple[int, ...]  # each distinct parameter tensor's elements
    trainable: int = 0  # of total, those that train (model.trainable; all when it is empty)
    muon: int = 0  # of trainable, those train.optimizer=muon steps with Muon (models/params.py on_muon)
    # Stacked expert weights, [experts, out, in] (a Hugging Face mixture of experts' gate_up_proj
    # and down_proj): multiplied per token only for the experts each token is routed to.
    experts: int = 0
    expert_layers: int = 0  # blocks that hold such stacked expert weights

    @property
    def frozen_matmul(self) -> int:
        """Matmul parameters that do not train (a LoRA base, model.trainable's others): each costs
        4 FLOPs per token, not 6 (forward and the input's gradient; no weight gradient). The
        trainable ones are taken as matmul weights (adapters are; a trained norm's few
        elements are counted frozen-side short)."""
        if not 0 < self.trainable < self.total:
            return 0
        return max(0, self.matmul - self.trainable)

    @property
    def largest(self) -> int:
        return max(self.numels)


@lru_cache(maxsize=64)
def counts_of(spec: Any) -> ModelCounts:
    """`spec`: a ModelSpec (built on the meta device, its blocks found through it)."""
    model = spec.build_meta(max_seq_len=1)
    distinct = {id(p): p for p in model.parameters()}  # parameters() already yields a tied weight once
    total = sum(p.numel() for p in distinct.values())
    tables = embedding_tables(model)
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    embedding = sum(distinct[i].numel() for i in embedding_ids)
    # Every 2-D weight outside an embedding table multiplies activations: nn.Linear, and
    # the same under other names (GPT-2's Conv1D); a tied head counts again here. Each tensor
    # once: PEFT's LoRA layer answers `.weight` with its base layer's, which is a module too.
    linear_weights = {
        id(w): w
        for m in model.modules()
        if isinstance(w := getattr(m, "weight", None), torch.Tensor) and w.dim() == 2
        if not isinstance(m, nn.Embedding)
    }.values()
    output = _output_head(model)
    untied_output = output.weight.numel() if output is not None and id(output.weight) not in embedding_ids else 0
    return ModelCounts(
        total=total,
        embedding=embedding,
        output=untied_output,
        non_embedding=total - embedding - untied_output,
        matmul=sum(w.numel() for w in linear_weights),
        block=max(sum(p.numel() for p in b.parameters()) for b in spec.blocks(model).children()),
        numels=tuple(p.numel() for p in distinct.values()),
        trainable=sum(p.numel() for p in distinct.values() if p.requires_grad),
        muon=sum(p.numel() for name, p in model.named_parameters() if p.requires_grad and on_muon(name, p, tables)),
        experts=sum(p.numel() for p in distinct.values() if p.dim() == 3),
        expert_layers=sum(any(p.dim() == 3 for p in b.parameters()) for b in spec.blocks(model).children()),
    )


def _output_head(model: nn.Module) -> nn.Linear | None:
    """The last Linear the model defines: its output projection."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None
