"""What the rest of scaletrain knows about a model: one small spec per model family.

Engines build, wrap, checkpoint and shard through it (never `model.layers`), the planner
counts and traces through it (never a model's own classes), the trainer takes the loss
from it. Counts come from the model built on the meta device, so they are exact for any
spec without a formula per family. The built-in Llama is the first spec; a Hugging Face
one follows the same protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models import llama_tp
from scaletrain.models.counts import ModelCounts, counts_of
from scaletrain.models.llama import (
    RMSNorm,
    TransformerBlock,
    build_meta_model,
    keep_stage,
    loss_fn,
    materialize,
    rope_tables,
)
from scaletrain.models.lora import LoraSpec, apply_lora, init_adapters, lora_spec, trainable_patterns
from scaletrain.models.moe import MoE, split_experts
from scaletrain.models.params import freeze_all_but
from scaletrain.models.presets import ModelShape, resolve_shape
from scaletrain.models.ulysses import Ulysses, heads_problem

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]  # (model output, targets) -> mean loss


class ModelSpec(Protocol):
    """A model family as engines, planner and trainer see it: the core every model has.
    Frozen and hashable: the planner caches by spec. What only some models offer (tensor
    parallel, pipeline stages, context parallel, experts to split, the planner's trace) is
    a capability (models/capabilities.py), asked for where it is needed."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def loss_chunk_tokens(self) -> int:
        """Positions per chunk of the cross entropy (0: all at once); the planner's loss memory."""

    @property
    def loss_compiled(self) -> bool:
        """train.compile: each full chunk of the chunked loss one compiled kernel (models/loss.py)."""

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream between blocks."""

    @property
    def n_blocks(self) -> int: ...

    def __hash__(self) -> int: ...

    def build_meta(self, max_seq_len: int) -> nn.Module:
        """The model on the meta device: no memory until an engine materializes it. Frozen
        parameters (model.trainable) already have requires_grad off, so every engine wraps
        and shards them as frozen and the optimizer never sees them."""

    def blocks(self, model: nn.Module) -> nn.Module:
        """The repeated units engines wrap, checkpoint and shard, as the container that holds
        them (a ModuleList, or a pipeline stage's ModuleDict): its children are the blocks,
        and setting a child replaces the block in place, so wrappers stick."""

    def materialize(self, model: nn.Module, device: torch.device, seed: int) -> None:
        """Allocate a meta-device (possibly sharded) model on `device` and initialize or load it."""

    def loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of one micro-batch from the model's output."""

    def config(self) -> dict[str, Any]:
        """What fixes the model's tensors (shape fields): a resume must match it."""

    def counts(self) -> ModelCounts: ...

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at this context length."""


def with_fields(spec: Any, **changes: Any) -> Any:
    """`dataclasses.replace` for a spec, through a wrapper (models/distill.py) to the spec it wraps."""
    inner = getattr(spec, "inner", None)
    if inner is not None:
        return replace(spec, inner=with_fields(inner, **changes))
    return replace(spec, **changes)


@dataclass(frozen=True)
class LlamaSpec:
    """The built-in Llama-style decoder of a given shape."""

    shape: ModelShape
    name: str = "llama"
    loss_chunk_tokens: int = 0  # train.loss_chunk_tokens: the cross entropy in chunks (0: whole)
    loss_compiled: bool = False  # train.compile: each chunk's loss one compiled kernel (models/loss.py)
    trainable: tuple[str, ...] = ()  # model.trainable: glob patterns; the rest is frozen (empty: none)
    lora: LoraSpec | None = None  # model.lora: peft adapters on a frozen base
    # data.document_mask: the eos that ends each document (models/documents.py), and the
    # mean span a token attends to under it (0: unknown, the whole sequence), for the FLOPs.
    document_eos: int | None = None
    mean_context: float = 0.0

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.shape.dim

    @property
    def n_blocks(self) -> int:
        return self.shape.n_layers

    def build_meta(self, max_seq_len: int) -> nn.Module:
        model = build_meta_model(self.shape, max_seq_len, self.document_eos)
        if self.lora is not None:
            apply_lora(model, self.lora)
        freeze_all_but(model, trainable_patterns(self.trainable, self.lora))
        return model

    def blocks(self, model: nn.Module) -> nn.Module:
        return model.layers  # type: ignore[return-value]

    def materialize(self, model: nn.Module, device: torch.device, seed: int) -> None:
        materialize(model, device, seed)  # type: ignore[arg-type]
        if self.lora is not None:
            init_adapters(model, seed)

    def loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        if isinstance(output, tuple):  # a mixture of experts: (logits, the routers' auxiliary loss)
            logits, aux = output
            # The value is the cross entropy alone, what a loss row compares with a dense run's
            # and an eval's; the gradient carries the auxiliary terms' too: aux - aux.detach()
            # is exactly 0 (a finite x - x), and its gradient aux's. The terms are logged apart.
            loss = loss_fn(logits, targets, self.loss_chunk_tokens, self.loss_compiled)
            extra = aux - aux.detach()
            if type(loss) is not torch.Tensor:  # a DTensor (loss parallel, tp): the same term on every tp rank
                from torch.distributed.tensor import DTensor

                assert isinstance(loss, DTensor)
                extra = DTensor.from_local(extra, loss.device_mesh, loss.placements, run_check=False)
            return loss + extra
        return loss_fn(output, targets, self.loss_chunk_tokens, self.loss_compiled)

    def config(self) -> dict[str, Any]:
        # The tensors' shapes: a dense model's without the (unused) expert fields, and never
        # the routing's loss weights or capacity, which a resume may change.
        shape = {k: v for k, v in asdict(self.shape).items() if k not in ROUTING}
        for key, usual in _USUAL_ATTENTION.items():  # written where a preset sets them (Qwen3's)
            if shape[key] == usual:
                del shape[key]
        if not self.shape.experts:
            shape = {k: v for k, v in shape.items() if k not in _EXPERT_SHAPE}
        return shape | ({"lora": self.lora.as_dict()} if self.lora else {})

    def counts(self) -> ModelCounts:
        return counts_of(self)

    def flops_per_token(self, seq_len: int) -> float:
        # 6 x the parameters used in a matmul (PaLM / Chinchilla), plus attention scores and
        # the weighted sum of values: 2 matmuls of 2 x seq_len x width FLOPs per layer and
        # token, x3 for the backward pass, over the full sequence (causal mask not halved);
        # under document masking over the token's document instead (its mean, mean_context).
        s = self.shape
        return float(
            6 * (self.counts().matmul + self.active_expert_params())
            + 12 * s.n_layers * s.n_heads * s.head_dim * self.context(seq_len)
        )

    def context(self, seq_len: int) -> float:
        """The span each token's attention is counted over: the sequence, or less under document masking."""
        return min(float(seq_len), self.mean_context) if self.mean_context > 0 else float(seq_len)

    def active_params(self) -> int:
        """Parameters a token passes through: all but the experts its router did not choose."""
        s = self.shape
        return self.counts().total - s.moe_layers * (s.experts - s.top_k) * 3 * s.dim * s.expert_ffn_dim

    def active_expert_params(self) -> int:
        """Expert weights each token is multiplied by (top_k of each MoE layer's experts): the
        stacked expert tensors are not Linear weights, so counts().matmul leaves them out."""
        s = self.shape
        return s.moe_layers * s.top_k * 3 * s.dim * s.expert_ffn_dim

    def traced_block(self, seq_len: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        # The largest block: a mixture of experts where the model has one.
        block = TransformerBlock(self.shape, 0 if self.shape.moe_layers else None)
        return block, rope_tables(self.shape.head_dim, seq_len, self.shape.rope_theta)

    def traced_head(self) -> nn.Module:
        return nn.Sequential(
            RMSNorm(self.shape.dim, self.shape.norm_eps), nn.Linear(self.shape.dim, self.shape.vocab_size, bias=False)
        )

    def check_tp(self, tp: int) -> None:
        if tp > 1 and self.lora is not None:
            raise UserError(
                f"parallel.tp={tp} does not combine with model.lora (the tp plan splits plain Linear layers); accepted: parallel.tp=1"
            )
        llama_tp.check_tp(self.shape, tp)

    def apply_tp(self, model: nn.Module, mesh: Any, sequence_parallel: bool, loss_parallel: bool) -> None:
        llama_tp.apply_tp(model, mesh, sequence_parallel, loss_parallel)

    def apply_cp(self, model: nn.Module, cp: Any) -> None:
        if isinstance(cp, Ulysses):
            heads, kv = self.shape.n_heads, self.shape.n_kv_heads
            problem = heads_problem(heads, kv, cp.size, cp.tp)
            if problem:
                accepted = [d for d in range(1, heads + 1) if not heads_problem(heads, kv, d, cp.tp)]
                raise UserError(
                    f"parallel.cp={cp.size} with cp_mode=ulysses splits the heads: {problem}; accepted: parallel.cp="
                    f"{', '.join(map(str, accepted))}, or cp_mode=allgather"
                )
        model.context_parallel = cp
        for module in model.modules():
            if isinstance(module, MoE):  # its balance term counts the whole sequences (models/moe.py)
                module.sequence_group = cp.group

    def check_ep(self, ep: int) -> None:
        e = self.shape.experts
        if ep > 1 and (not e or e % ep):
            accepted = ", ".join(str(d) for d in range(1, e + 1) if e % d == 0) if e else "1"
            raise UserError(
                f"parallel.ep={ep} must divide the experts per layer ({e}: model.moe.experts); accepted: parallel.ep={accepted}"
            )

    def split_experts(self, model: nn.Module, ep_mesh: Any) -> list[nn.Module]:
        return split_experts(model, ep_mesh)

    def check_pp(self, pp: int) -> None:
        if pp > 1 and self.lora is not None:
            raise UserError(f"parallel.pp={pp} does not combine with model.lora (not checked yet); accepted: parallel.pp=1")
        if pp > 1 and self.document_eos is not None:
            raise UserError(
                f"parallel.pp={pp} does not combine with data.document_mask: a stage after the first receives hidden states, "
                "not the tokens whose eos marks the documents; accepted: parallel.pp=1, or data.document_mask=false"
            )
        if pp > 1 and self.shape.tie_embeddings:
            raise UserError(
                f"parallel.pp={pp} needs untied embeddings: this model shares its input embedding with its output head, "
                "which sit on the first and the last pipeline stage; accepted: model.tie_embeddings=false, or parallel.pp=1"
            )

    def pipeline_stage(self, model: nn.Module, blocks: range, first: bool, last: bool) -> None:
        keep_stage(model, blocks, first, last)  # type: ignore[arg-type]

    def stage_costs(self, seq_len: int) -> tuple[float, float, float]:
        # As flops_per_token, split by where the work happens; an embedding lookup does no
        # matmul. The head is the output projection (the norm's FLOPs are negligible).
        s = self.shape
        block = 6 * self.counts().block + 12 * s.n_heads * s.head_dim * self.context(seq_len)
        return 0.0, float(block), float(6 * s.dim * s.vocab_size)


# ModelShape's fields that shape no tensor (the routing, how the experts run); and those of the experts.
ROUTING = (
    "capacity_factor", "normalize_top_k", "aux_loss_weight", "balance", "z_loss_weight", "experts_impl", "score", "groups",
    "topk_groups",
)  # fmt: skip
_EXPERT_SHAPE = ("experts", "top_k", "shared_experts", "expert_ffn_dim", "dense_layers")
# Attention fields at their usual value, left out of config(): a checkpoint written before they
# existed names the same shape.
_USUAL_ATTENTION = {"attention_head_dim": 0, "qk_norm": False}


def count_params(shape: ModelShape) -> dict[str, int]:
    """Parameter counts of the built-in Llama of `shape` (see ModelCounts)."""
    c = LlamaSpec(shape).counts()
    return {"total": c.total, "embedding": c.embedding, "output": c.output, "non_embedding": c.non_embedding}


def flops_per_token(shape: ModelShape, seq_len: int) -> float:
    return LlamaSpec(shape).flops_per_token(seq_len)


def from_section(m: Any, vocab_size: int | None, lora: Any, document_eos: int | None, common: dict[str, Any]) -> LlamaSpec:
    """model.source=builtin (config/sources.py): the preset's shape with the section's fields."""
    return LlamaSpec(resolve_shape(m, vocab_size), lora=lora_spec(lora, None), document_eos=document_eos, **common)


def from_saved(fields: dict[str, Any], adapters: LoraSpec | None) -> LlamaSpec:
    """A checkpoint's built-in model: its shape as trainer.json holds it."""
    return LlamaSpec(ModelShape(**fields), lora=adapters)
