"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases.

The model is built on the meta device and materialized by `init_weights`, so a 70B shape
costs nothing until an engine has sharded it. Initialization is a pure function of
(seed, parameter name): every rank, device and sharding layout gets the same numbers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.context_parallel import ContextParallel
from scaletrain.models.documents import attend, document_layout, document_mask
from scaletrain.models.feed_forward import FeedForward
from scaletrain.models.loss import HeadTiles, cross_entropy, tiled_cross_entropy
from scaletrain.models.moe import EXTRA_STATS, MoE
from scaletrain.models.params import base_name, canonical_name, copy_full, is_adapter, name_generator
from scaletrain.models.presets import ModelShape

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32: in bf16 the mean of squares loses the precision that matters.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [max_seq_len, head_dim // 2], computed on CPU in fp64 then fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x [B, T, H, hd] by position (rotate-half
    form); cos and sin [T, hd/2], or [B, T, hd/2] where each sample has its own positions."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    if cos.dim() == 2:  # broadcast over batch and heads
        cos, sin = cos[None], sin[None]
    cos = cos[:, :, None, :].float()
    sin = sin[:, :, None, :].float()
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, shape.n_kv_heads, shape.head_dim
        self.wq = nn.Linear(shape.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(shape.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, shape.dim, bias=False)
        # Qwen3: each head's queries and keys normalized (one weight per channel of a head, shared by the heads).
        self.q_norm = RMSNorm(self.head_dim, shape.norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, shape.norm_eps) if shape.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any = None) -> torch.Tensor:
        """`mask`: None (causal), or the documents' mask (models/documents.py), with cos and
        sin then gathered at each token's position in its document [B, T, hd/2]."""
        b, t, _ = x.shape
        if cos.dim() == 2:
            # The tables may be longer than this sequence: a pipeline stage that receives
            # sequence-parallel hidden states cannot tell the full length from its input.
            cos, sin = cos[:t], sin[:t]
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them (llama_tp.py).
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [B, heads, T, hd]
        # enable_gqa lets the fused kernels read each kv head for its group of query heads
        # instead of materializing repeated copies of k and v.
        out = attend(q, k, v, mask, gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class TransformerBlock(nn.Module):
    """One pre-norm residual block; the unit engines wrap for FSDP and checkpointing. With
    `moe`, its feed-forward is a mixture of experts (models/moe.py), which also returns
    its auxiliary loss and routing statistics: the block then returns (hidden states, aux,
    stats) and the model sums the blocks' terms."""

    def __init__(self, shape: ModelShape, moe_row: int | None = None):
        super().__init__()
        moe = moe_row is not None
        self.attention_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.attention = Attention(shape)
        self.ffn_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.feed_forward: nn.Module = MoE(shape, moe_row) if moe_row is not None else FeedForward(shape.dim, shape.ffn_dim)
        self.moe = moe

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any = None) -> Any:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        if not self.moe:
            return x + self.feed_forward(self.ffn_norm(x))
        y, aux, stats = self.feed_forward(self.ffn_norm(x))
        return x + y, aux, stats


class Llama(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, shape: ModelShape, max_seq_len: int, document_eos: int | None = None):
        super().__init__()
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len}")
        self.shape, self.max_seq_len = shape, max_seq_len
        # data.document_mask: attention and positions per document, found by this eos (models/documents.py).
        self.document_eos = document_eos
        # parallel.cp: this rank's chunks of each sequence (models/context_parallel.py), set by the engine.
        self.context_parallel: ContextParallel | None = None
        # Given a weight, the embedding skips its own random init (init_weights draws every
        # parameter): a normal_ on the meta device would import torch._dynamo (~0.8 s).
        # None on a pipeline stage that does not hold them (keep_stage).
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(
            shape.vocab_size, shape.dim, _weight=torch.empty(shape.vocab_size, shape.dim)
        )
        # A pipeline stage keeps its blocks in a ModuleDict under their own indices (keep_stage).
        self.layers: nn.ModuleList | nn.ModuleDict = nn.ModuleList(
            TransformerBlock(shape, i - shape.dense_layers if shape.experts > 0 and i >= shape.dense_layers else None)
            for i in range(shape.n_layers)
        )
        self.norm: RMSNorm | None = RMSNorm(shape.dim, shape.norm_eps)
        self.output: nn.Linear | None = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        self.tie_weights()
        # Non-persistent: derived from the shape, so checkpoints need not carry them. On the
        # meta device they hold no data (and computing them there would import
        # torch._dynamo, ~0.8 s per process): init_weights (after to_empty) fills them.
        if torch.empty(0).is_meta:
            cos = sin = torch.empty(max_seq_len, shape.head_dim // 2)
        else:
            cos, sin = rope_tables(shape.head_dim, max_seq_len, shape.rope_theta)
        # Routing statistics of the training forwards since routing_stats took them
        # [MoE layers, experts + EXTRA_STATS] (models/moe.py), on the device, no sync.
        self.moe_stats: torch.Tensor | None = None
        # model.moe.balance=bias: the slots per expert [MoE layers, experts] of the training
        # forwards since the optimizer step; None unless ExpertBias set it (models/moe.py).
        self.moe_load: torch.Tensor | None = None
        # A pipeline stage's rows of those tables (keep_stage): the MoE layers it holds.
        self.moe_rows = range(shape.moe_layers)
        # False while a forward is no training step's though it runs with gradients: torch's
        # pipelining infers the stages' shapes that way (engines/pipeline.py).
        self.moe_counting = True
        # train.tile_tokens (models/feed_forward.py `tile`): in training, the head and the loss
        # tile by tile (models/loss.py HeadTiles); 0: the logits whole.
        self.tile_tokens = 0
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the shape says so.

        `to_empty` allocates each module's parameters separately and so unties them; call
        this again after any such re-materialization (build_model does).
        """
        if self.shape.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, aux_before: torch.Tensor | None = None) -> Any:
        """tokens LongTensor[B, T] -> logits [B, T, vocab_size]. A pipeline stage (see
        `keep_stage`) without the embedding takes hidden states [B, T, dim] instead, and
        one without the head returns them; in a mixture of experts, with the auxiliary
        loss of the blocks so far beside them (`aux_before` from the stage before), so
        the last stage's loss carries every stage's and its gradient reaches them all."""
        if tokens.shape[1] > self.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds the model's max_seq_len={self.max_seq_len} "
                f"(rotary tables are precomputed up to it); build the model with a larger max_seq_len"
            )
        cos, sin = self.rope_cos, self.rope_sin  # each attention takes the first T rows
        mask: Any = None
        doc = position = None
        if self.document_eos is not None and self.tok_embeddings is not None:
            doc, position = document_layout(tokens, self.document_eos)
        cp = self.context_parallel
        if cp is not None:  # this rank's chunks, at their global (or in-document) positions
            held = cp.positions(tokens.shape[1], tokens.device)
            at = held if position is None else position[:, held]
            mask = cp.attention(tokens.shape[1], held, doc)
            tokens, cos, sin = tokens[:, held], cos[at], sin[at]
        elif doc is not None and position is not None:
            cos, sin, mask = cos[position], sin[position], document_mask(doc)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        aux: list[torch.Tensor] = [] if aux_before is None else [aux_before]  # the MoE layers' auxiliary losses
        stats: list[torch.Tensor] = []  # and what each routed (models/moe.py)
        for layer in self.layers.children():  # a ModuleList, or a stage's ModuleDict
            h = layer(h, cos, sin, mask)
            if isinstance(h, tuple):
                h, term, seen = h
                aux.append(term)
                stats.append(seen)
        if stats and torch.is_grad_enabled() and self.moe_counting:
            # Summed here, not in the layers: activation checkpointing runs a block's
            # forward again in backward, and only the first run returns to this loop.
            seen = torch.stack(stats).double()  # counts stay whole numbers past 2**24 per interval
            if len(self.moe_rows) != self.shape.moe_layers:  # a stage's rows, in the whole model's table
                seen = F.pad(seen, (0, 0, self.moe_rows.start, self.shape.moe_layers - self.moe_rows.stop))
            self.moe_stats = seen if self.moe_stats is None else self.moe_stats + seen
            if self.moe_load is not None:
                self.moe_load += seen[:, :-EXTRA_STATS]
        if self.output is None or self.norm is None:
            if self.shape.moe_layers:  # a stage without MoE layers passes the sum on (zero on the first)
                return h, torch.stack(aux).sum() if aux else torch.zeros((), device=h.device)
            return h
        # train.tile_tokens: the loss runs the head tile by tile (models/loss.py HeadTiles).
        logits = HeadTiles(h, self._head, self.tile_tokens) if self.tile_tokens else self._head(h)
        # A mixture of experts returns its auxiliary loss beside the logits: the spec's loss
        # adds it, so it is scaled like the loss (accumulation, fp16 loss scaling) everywhere.
        return (logits, torch.stack(aux).sum()) if aux else logits

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        assert self.output is not None and self.norm is not None
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter and the RoPE tables deterministically.

        Each parameter draws from its own CPU generator seeded by (seed, crc32(name)) in fp32,
        then is copied into place, so the values do not depend on the device, on the order
        in which parameters are visited, or on how (or whether) the model is sharded.
        """
        cos, sin = rope_tables(self.shape.head_dim, self.max_seq_len, self.shape.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        # Residual-branch output projections are scaled down so that the residual stream's
        # variance does not grow with depth (GPT-2 / Megatron convention).
        out_std = INIT_STD / math.sqrt(2 * self.shape.n_layers)
        # named_parameters yields a tied weight once, under tok_embeddings.weight.
        for name, param in self.named_parameters():
            name = base_name(canonical_name(name))  # a LoRA base weight is seeded as without LoRA
            if is_adapter(name):
                continue  # lora.init_adapters
            if name.endswith("norm.weight"):
                full = torch.ones(param.shape, dtype=torch.float32)
            else:
                # The experts' stacked down projections (feed_forward.experts.w2) are residual outputs too.
                std = out_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else INIT_STD
                full = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=name_generator(seed, name))
            copy_full(param, full)


def keep_stage(model: Llama, blocks: range, first: bool, last: bool) -> None:
    """Cut `model` (on the meta device) down to one pipeline stage, in place: the blocks in
    `blocks`, kept under their own indices (a ModuleDict "7": ..., so parameter names stay
    those of the whole model), the embedding on the first stage, norm and head on the last."""
    every = dict(model.layers.named_children())
    model.layers = nn.ModuleDict({str(i): every[str(i)] for i in blocks})
    dense = model.shape.dense_layers
    model.moe_rows = range(max(blocks.start - dense, 0), max(blocks.stop - dense, 0)) if model.shape.moe_layers else range(0)
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = model.output = None


def build_meta_model(shape: ModelShape, max_seq_len: int, document_eos: int | None = None) -> Llama:
    """Construct on the meta device: no memory, so engines can wrap/shard before allocating."""
    with torch.device("meta"):
        return Llama(shape, max_seq_len, document_eos)


def materialize(model: Llama, device: str | torch.device, seed: int) -> None:
    """Allocate a meta-device (possibly already sharded) model on `device` and initialize it."""
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)


def build_model(
    shape: ModelShape, max_seq_len: int, seed: int, device: str | torch.device = "cpu", document_eos: int | None = None
) -> Llama:
    """Construct on the meta device (no memory), allocate on `device`, then initialize."""
    model = build_meta_model(shape, max_seq_len, document_eos)
    materialize(model, device, seed)
    return model


def loss_fn(logits: Any, targets: torch.Tensor, chunk_tokens: int = 0, compiled: bool = False) -> torch.Tensor:
    """Mean next-token cross entropy in fp32, whole or `chunk_tokens` positions at a time, or
    the head and the loss tile by tile (HeadTiles: train.tile_tokens) (models/loss.py)."""
    if isinstance(logits, HeadTiles):
        return tiled_cross_entropy(logits, targets, chunk_tokens)
    return cross_entropy(logits, targets, chunk_tokens, compiled)
