"""Per-device memory of one training step, by component, for each strategy.

Model states follow the ZeRO paper's recipe (arXiv 1910.02054) with the bytes each engine
really stores; activations come from tracing the real block (activations.py). The peak is
the largest of these moments, each seen in measurements (docs/planner.md):
  backward start: resident states + every saved activation + the loss's fp32 temporaries
  first gradient: (ZeRO-1/2) resident states + every block's activations + the reduce buckets,
                  allocated when the first gradient arrives
  backward end:   resident states + all gradients + the embedding's dense gradient temporaries
  optimizer step: resident states + all gradients + the optimizer's temporary (ZeRO-1/2:
                  the gradient partition, its flat copy and that copy in fp32)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from scaletrain.config import TrainConfig
from scaletrain.models.spec import ModelSpec
from scaletrain.optim.registry import ADAMW_STATE_BYTES, optimizer
from scaletrain.planning.activations import HeadActivations, block_activations, head_activations
from scaletrain.planning.clock.trace import block_work
from scaletrain.planning.experts import experts_of, tp_split, ungathered
from scaletrain.planning.float8 import buffer_saving, saved_saving
from scaletrain.planning.pipeline import gathered_stage_bytes, in_flight, rank_share
from scaletrain.planning.setup import Setup
from scaletrain.strategies import TABLE

# ZeRO-Infinity's page-locked host buffers (DeepSpeed 0.19.8 defaults, which the generated
# config keeps): offload_param buffer_count x buffer_size elements, offload_optimizer
# buffer_count sub-group partitions, ZeRO-3's sub_group_size.
NVME_PARAM_BUFFERS = 5 * 100_000_000
NVME_OPTIMIZER_BUFFERS = 4
ZERO3_SUB_GROUP = 1_000_000_000


@dataclass(frozen=True)
class Memory:
    """Bytes per device at the step's peak, by component; CPU bytes for offloaded state."""

    params: float
    grads: float
    optimizer: float
    activations: float
    loss: float  # final norm + logits + loss saved tensors and their fp32 gradient temporaries
    buffers: float  # engine buffers: gathered FSDP units, DeepSpeed buckets, optimizer temporaries
    peak: float
    peak_phase: str  # the moment of the peak: a key of estimate()'s phases ("backward start", ...)
    cpu: float  # host memory for offloaded optimizer state / parameters, and NVMe offload's swap buffers
    nvme: float = 0.0  # bytes per device in parallel.nvme_path's swap files (ZeRO-Infinity)

    def as_dict(self) -> dict[str, float | str]:
        return asdict(self)


def regime(strategy: str, precision: str) -> str:
    """How the engine runs its forward (see activations.REGIMES): DDP autocasts over fp32
    weights; FSDP2's MixedPrecisionPolicy and DeepSpeed hold 16-bit weights and activations."""
    return "fp32" if precision == "fp32" else TABLE[strategy].forward16


def _state_bytes_per_param(strategy: str, precision: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter before sharding."""
    row = TABLE[strategy]
    # torch engines keep fp32 weights (autocast / MixedPrecisionPolicy cast on the fly),
    # fp32 gradients (fp32 reduce) and AdamW's two fp32 moments. DeepSpeed's module holds
    # the compute dtype and its ZeRO optimizer an fp32 partition of the weights besides the
    # two moments (K = 12, also in fp32 runs); ZeRO-3 reduces gradients straight into an
    # fp32 partition, ZeRO-1/2 keep them in the weights' dtype and convert at the step.
    weights = 4.0 if row.fp32_module or precision == "fp32" else 2.0
    return weights, 4.0 if row.fp32_grads else weights, row.optimizer_bytes


def estimate(model: ModelSpec, s: Setup) -> Memory:
    row = TABLE[s.strategy]
    # With a pipeline: the parameters of the rank holding the most (its stages only).
    n_params = rank_share(model, s.pp, s.pp_schedule, s.seq_len)[0]
    w, g, o = _state_bytes_per_param(s.strategy, s.precision)
    shard = s.shard
    # Frozen parameters (model.trainable) keep their weights only: no gradient, no
    # optimizer state, no fp32 master.
    n_train = n_params * trainable_share(model)
    params, grads, optim = w * n_params, g * n_train, o * n_train
    entry = optimizer(s.optimizer)
    # train.optimizer's own state in place of AdamW's two moments (optim/registry.py), and
    # its state for the blocks' matrices where it steps them by a rule of its own (Muon: one
    # momentum; its Newton-Schulz iterations work on one matrix at a time, a few bf16 copies
    # of the largest, under a percent of a model's states: left out).
    optim += (entry.state_bytes - ADAMW_STATE_BYTES) * n_train
    if entry.matrix_state_bytes is not None:
        optim -= (entry.state_bytes - entry.matrix_state_bytes) * n_train * muon_share(model)
    # ZeRO's stages: what the shard group partitions (strategies.Strategy.partitions).
    optim /= shard if row.partitions >= 1 else 1
    grads /= shard if row.partitions >= 2 else 1
    params /= shard if row.partitions >= 3 else 1
    if row.persistence_threshold and s.offload_params == "none":
        # Tensors under stage3_param_persistence_threshold (DeepSpeed's default 1e5 elements)
        # are kept whole on every rank instead of being partitioned.
        small = sum(n for n in model.counts().numels if n < row.persistence_threshold)
        params += w * small * (1 - 1 / shard)
    # ZeRO-1/2 step: the gradient partition is flattened into fp32 for the optimizer
    # (DeepSpeed's estimators count it as "4 bytes grads_32bit").
    fp32_grad_partition = 4.0 * n_train / shard if row.fp32_grad_partition else 0.0

    cpu = nvme = 0.0
    if s.offload_optimizer != "none":
        # ZeRO-Offload: fp32 master, moments and the fp32 gradient partition live on the
        # host; reduced gradients go straight there, the device keeps only the buckets.
        # To NVMe, the master and moments go to swap files and the host keeps the gradient
        # partition and the optimizer swapper's page-locked buffers: buffer_count (4) of the
        # largest sub-group's fp32 partition (sub_group_size 1e9 elements), measured
        # byte-exact in tests/test_nvme_offload.py for the files.
        if s.offload_optimizer == "nvme":
            nvme += optim
            cpu += 4.0 * n_train / shard + NVME_OPTIMIZER_BUFFERS * 4.0 * min(n_train / shard, ZERO3_SUB_GROUP)
        else:
            cpu += optim + 4.0 * n_train / shard
        optim, grads, fp32_grad_partition = 0.0, 0.0, 0.0
    if s.offload_params != "none":
        if s.offload_params == "nvme":
            # The parameter partitions in the run's dtype and their fp32 gradients go to
            # swap files; the host page-locks buffer_count x buffer_size elements to read
            # them back through (DeepSpeed's defaults: 5 x 1e8, whatever the model's size).
            nvme += params + 4.0 * n_train / shard
            cpu += NVME_PARAM_BUFFERS * w
        else:
            cpu += params
        params = 0.0
    # Tensor parallel splits every matrix (the norms, replicated, are negligible) but a
    # mixture of experts' (whole on every tp rank), so each rank's states are that share of
    # its data-parallel shard; so are the gathered units.
    split = tp_split(model, s)
    params, grads, optim, cpu, nvme, fp32_grad_partition = (
        x * split for x in (params, grads, optim, cpu, nvme, fp32_grad_partition)
    )

    act, loss, recompute, held = _activations(model, s)
    cpu += held  # train.activation_offload: what the forward saved, but the block in flight
    buffers = engine_buffers(model, s) * split
    # ZeRO-1/2's reduce buckets live inside backward only (engine_buffers says when): they
    # are not resident, and join only the phases from the first gradient to backward's end.
    buckets = buffers if row.buffers == "buckets" else 0.0
    buffers -= buckets
    if s.teacher is not None:
        teacher_weights, teacher_buffers = teacher_bytes(s.teacher, s)
        params += teacher_weights
        buffers += teacher_buffers
        # The KL keeps the student's fp32 log-probabilities and the teacher's (its target)
        # for backward, beside the cross entropy's own: two more fp32 logit-sized tensors.
        loss += 2.0 * s.micro_batch * s.local_seq_len * model.vocab_size * 4.0
    # Gradients that persist between steps: DDP's bucket views (only with a DDP wrapper,
    # world > 1) and ZeRO-3's flat gradient partition. Otherwise they are freed every step:
    # by zero_grad, or (ZeRO-1/2) by DeepSpeed itself, which drops its gradient partition in
    # _release_ipg_buffers at backward's end and the averaged gradients in step().
    persistent = row.grads_persist == "always" or (row.grads_persist == "distributed" and s.reduce_ranks > 1)
    persistent_grads = grads if persistent else 0.0
    transient_grads = grads - persistent_grads
    resident = params + optim + buffers + persistent_grads
    # The embedding's gradient is dense (vocab x dim) and is produced, then added to the
    # (tied or own) gradient, unsharded: two such temporaries at the end of backward.
    head_grad = model.vocab_size * model.hidden_size * (4.0 if row.fp32_module else w) / s.tp
    embedding_temp = 2.0 * head_grad
    # torch's single-tensor / fused AdamW step allocates at most one parameter-sized
    # temporary.
    step_grads = transient_grads
    step_temp = 4.0 * model.counts().largest / s.tp if row.fp32_module else 0.0
    if row.buffers == "buckets" and s.offload_optimizer == "none":
        # ZeRO-1/2's step() (stage_1_and_2.py) holds only this rank's gradient partition in
        # the weights' dtype (averaged_gradients, views of grads_in_partition; ZeRO-1's whole
        # gradients were freed at backward's end), flattens it into a new tensor and converts
        # that to fp32 for the optimizer (`.to` is a no-op in fp32 runs): 8 bytes per
        # partitioned parameter in fp32 and in bf16 alike.
        step_grads = w * n_train / shard / s.tp
        step_temp = step_grads + (fp32_grad_partition if w < 4.0 else 0.0)
    # Activation checkpointing: one block's activations are rebuilt later in backward, once
    # the loss temporaries are gone; count every gradient as already there (upper bound).
    at_recompute = act + transient_grads
    if s.tile_tokens and not s.activation_checkpointing:
        # train.tile_tokens alone: a tile is recomputed in every block's backward; at block
        # i's, the blocks above hold their gradients and those below their activations, a
        # sum linear in i, largest at the last block (every activation, the head's gradient)
        # or the first (one block's activations, every gradient).
        blocks = rank_share(model, s.pp, s.pp_schedule, s.seq_len)[1]
        at_recompute = max(act + min(head_grad, transient_grads), act / blocks + transient_grads)
    phases = {
        "backward start": (resident + act + loss, 0.0),
        "block recompute": (resident + at_recompute + recompute + buckets, buckets),
        "backward end": (resident + transient_grads + embedding_temp + buckets, embedding_temp + buckets),
        "optimizer step": (resident + step_grads + step_temp, step_temp),
    }
    if buckets:
        # DeepSpeed allocates the buckets in the first gradient hook (setup_buckets, from
        # process_gradients), once the loss and the head have run backward: the loss's
        # temporaries are gone, every block's activations and the head's weight gradient
        # (vocab x dim) are there.
        phases["first gradient"] = (resident + act + head_grad + buckets, head_grad + buckets)
    phase = max(phases, key=lambda k: phases[k][0])
    peak, extra = phases[phase]
    return Memory(params, grads, optim, act, loss, buffers + extra, peak, phase, cpu, nvme)


def teacher_bytes(teacher: ModelSpec, s: Setup) -> tuple[float, float]:
    """(resident weights, gathered buffers) of a frozen teacher held as engines/teacher.py
    holds it. Its forward runs under no_grad: it saves no activations, and what it makes
    is freed block by block (a block's output at a time, small beside the weights)."""
    c = teacher.counts()
    compute = 4.0 if s.precision == "fp32" else 2.0
    holding = TABLE[s.strategy].teacher_holding
    if holding == "fsdp_units":
        # fp32 shards; the unit running is gathered in the compute dtype (each block, then
        # the rest: the larger of the two at a time, plus the block prefetched).
        return 4.0 * c.total / s.shard, compute * max(c.total - teacher.n_blocks * c.block, 2 * c.block)
    if holding == "zero3_partitions":
        # 16-bit partitions (DeepSpeed casts the frozen engine's module too), each module
        # gathered for its forward.
        return compute * c.total / s.shard, compute * c.largest
    return compute * c.total, 0.0  # a full copy in the compute dtype


def trainable_share(model: ModelSpec) -> float:
    """The share of the parameters that train (1 unless model.trainable freezes some)."""
    c = model.counts()
    return c.trainable / c.total if c.trainable else 1.0


def muon_share(model: ModelSpec) -> float:
    """The share of the trained parameters a matrix optimizer steps (train.optimizer=muon:
    models/params.py on_muon)."""
    c = model.counts()
    return c.muon / (c.trainable or c.total)


def groups_note(train: TrainConfig) -> list[str]:
    """train.param_groups as the plan takes them: a parameter keeps the same state at any
    learning rate or decay, so its entries change no term of the plan (said, not silent)."""
    n = len(train.param_groups)
    if not n:
        return []
    return [
        f"train.param_groups: {n} {'entry' if n == 1 else 'entries'} of learning-rate multipliers and weight decay, "
        "which change no memory, traffic or step time: the plan is the same without them"
    ]


def muon_gather_bytes(model: ModelSpec, s: Setup, psi: float) -> float:
    """train.optimizer=muon under sharding: each matrix's fp32 update gathered whole once per
    step (optim/muon.py ShardedMuon) over the data-parallel and the tp ranks, of a rank
    holding `psi` parameters; a mixture of experts' stacks only where FSDP cuts inside the
    experts (a rank's E/ep fewer than the shard/ep ranks holding them), else each rank
    orthogonalises its own experts where they are. 0 for AdamW."""
    if not optimizer(s.optimizer).gathers_matrices:
        return 0.0
    gathered = muon_share(model)
    e = experts_of(model)
    if e is not None and e.experts // s.ep >= s.shard // s.ep:
        gathered -= e.total / model.counts().total
    whole, n = psi / tp_split(model, s) * trainable_share(model) * gathered, s.shard * s.tp
    return (n - 1) / n * whole * 4


def model_state_bytes(model: ModelSpec, s: Setup) -> tuple[float, float]:
    """(device, host) bytes of weights + gradients + optimizer state at the optimizer step,
    the quantity the ZeRO paper and DeepSpeed's estimators give, without buffers."""
    m = estimate(model, s)
    n_params = model.counts().total
    step_grad = (
        4.0 * n_params * trainable_share(model) / s.shard
        if TABLE[s.strategy].fp32_grad_partition and s.offload_optimizer == "none"
        else 0.0
    )
    return m.params + m.grads + m.optimizer + step_grad, m.cpu


def offloaded_activations(model: ModelSpec, s: Setup) -> float:
    """train.activation_offload: bytes one micro-batch's forward moves to the host."""
    return _activations(model, s)[3]


def ffn_hidden_bytes(model: ModelSpec, s: Setup, tokens: int) -> float:
    """What a block's feed-forward saves for `tokens` positions, all of which a tile
    (train.tile_tokens) recomputes instead: four tensors as wide as its hidden layer (w1's
    and w3's outputs, silu's and the product: models/feed_forward.py), and a mixture of
    experts' routed slots (top_k a token): each its input, its expert's output and the weighted
    output (index_add_ keeps it), `dim` wide."""
    shape = getattr(model, "shape", None)
    if shape is None:
        return 0.0
    size = 4.0 if s.precision == "fp32" else 2.0
    slots = 3.0 * tokens * shape.top_k * shape.dim if shape.experts else 0.0
    return (4.0 * tokens * ffn_width(shape) / s.tp + slots) * size


def ffn_width(shape: Any) -> int:
    """A token's feed-forward width: the dense ffn_dim, or its top_k experts' and the shared
    experts' together (models/moe.py)."""
    if not shape.experts:
        return int(shape.ffn_dim)
    return int((shape.top_k + shape.shared_experts) * shape.expert_ffn_dim)


# The length the selective policy's kept outputs are traced at: each is a token's row (a
# product's output, the attention's output and log-sum-exp), so they scale with the tokens.
SELECTIVE_TRACE = 2048


def selective_kept(model: ModelSpec, s: Setup, r: str, low: torch.dtype) -> float:
    """Bytes a block under selective checkpointing keeps beside its input, on one rank: the
    outputs models/selective_ac.py keeps, as the clock's trace of the block's forward finds
    them (its operations in order), per token, 1/tp of them per rank."""
    t = min(s.local_seq_len, SELECTIVE_TRACE)
    per_token = block_work(model, 1, t, r, low).selective_saved / t
    return per_token * s.micro_batch * s.local_seq_len / s.tp


def _activations(model: ModelSpec, s: Setup) -> tuple[float, float, float, float]:
    """(saved activations at backward start, loss-side bytes, one block recomputed under AC
    or one feed-forward tile recomputed without it, the bytes held on the host)."""
    low = torch.float16 if s.precision == "fp16" else torch.bfloat16
    r = regime(s.strategy, s.precision)
    # Under cp a rank holds seq_len / cp tokens of each sequence: traced at that length,
    # plus the keys and values of the rest of the sequence, all-gathered and saved by
    # each block's attention for backward.
    block = block_activations(model, s.micro_batch, s.local_seq_len, r, low)
    head = _head(model, s, r, low)
    recompute = 0.0
    saved = (block.saved - saved_saving(model, s, r, low.itemsize)) / s.tp + gathered_kv_bytes(model, s, low)
    if s.tp > 1 and not s.sequence_parallel:
        # Without sequence parallel four [tokens, hidden] tensors per block stay whole on
        # every rank: both norms' inputs and outputs (the latter feed the column-parallel
        # matmuls). An estimate (Megatron's accounting, arXiv 2205.05198), not a trace.
        saved += 4 * block.block_input * (1 - 1 / s.tp)
    block_input = block.block_input / (s.tp if s.sequence_parallel else 1)
    tile = 0.0
    if s.tile_tokens and s.tile_tokens < s.local_seq_len:
        # train.tile_tokens: the feed-forward's hidden activations are recomputed per tile
        # in backward (its tiles' inputs are views of the norm's output, already saved).
        tokens = s.micro_batch * s.local_seq_len
        saved -= ffn_hidden_bytes(model, s, tokens)
        tile = ffn_hidden_bytes(model, s, s.micro_batch * s.tile_tokens)
    # A pipeline rank runs its own blocks, for several micro-batches in flight.
    blocks = rank_share(model, s.pp, s.pp_schedule, s.seq_len)[1] * in_flight(s)
    kept = block_input if s.activation_checkpointing else saved  # each checkpointed block keeps only its input
    if s.activation_checkpointing and s.selective:
        kept += selective_kept(model, s, r, low)
    act = blocks * kept
    recompute = float(saved) + tile if s.activation_checkpointing else tile
    # train.activation_offload (on a GPU): what the blocks keep goes to the host, but the
    # block whose copy is in flight; the head's and the loss's stay (needed first).
    held = act - kept if s.activation_offload else 0.0
    act -= held
    # Backward through the loss: the fp32 gradient of the logits and one fp32 temporary
    # of the same size (softmax gradient) exist together, before any block runs backward.
    # With tp the logits stay split over the vocabulary (loss parallel). The chunked loss
    # (models/loss.py) writes the gradient in the logits' dtype, with fp32 temporaries of
    # one chunk (the traced saved bytes already hold its logits and log-sum-exps).
    chunk = model.loss_chunk_tokens
    if tile:
        # train.tile_tokens: the head and the loss run tile by tile under checkpoints
        # (models/loss.py HeadTiles): the last block's output is kept, and one tile's logits
        # exist at a time, with their fp32 copy (none when they are fp32 already), the
        # log-softmax and its gradient. A tile there is tile_tokens rows of the micro-batch's
        # positions, or the loss chunk's where fewer.
        act_bytes = 4.0 if s.precision == "fp32" else low.itemsize
        tokens = s.micro_batch * s.local_seq_len
        rows = min(s.tile_tokens, chunk or s.tile_tokens, tokens)
        fp32_copy = 0.0 if act_bytes == 4.0 else 4.0
        loss = tokens * model.hidden_size * act_bytes + rows * model.vocab_size * (act_bytes + fp32_copy + 2 * 4.0)
    elif chunk:
        tokens = s.micro_batch * s.local_seq_len
        loss = head.saved + head.logits + 2 * head.logits_fp32 * min(chunk, tokens) / tokens
    else:
        loss = (head.saved + 2 * head.logits_fp32) / s.tp
    return float(act), float(loss), recompute, float(held)


# The head and the loss save bytes in proportion to their positions (logits, log-sum-exps,
# the norm's input): traced at most this many, scaled beyond (the chunked loss's Python loop
# over fake tensors takes seconds per million positions).
HEAD_TRACE = 16384


def _head(model: ModelSpec, s: Setup, regime: str, low: torch.dtype) -> HeadActivations:
    traced = min(s.local_seq_len, HEAD_TRACE)
    head = head_activations(model, s.micro_batch, traced, regime, low)
    if traced == s.local_seq_len:
        return head
    k = s.local_seq_len / traced
    return HeadActivations(int(head.saved * k), int(head.logits * k), int(head.logits_fp32 * k))


def kv_width(model: ModelSpec) -> int:
    """Channels of one token's keys (and of its values): n_kv_heads x head_dim."""
    shape = getattr(model, "shape", None)
    return shape.n_kv_heads * shape.head_dim if shape is not None else model.hidden_size


def gathered_kv_bytes(model: ModelSpec, s: Setup, low: torch.dtype) -> float:
    """Under cp: the other ranks' keys and values one block's attention keeps for backward.
    Ulysses keeps none: its attention saves q, k, v of 1/cp of the heads for all positions,
    the bytes of all heads for this rank's positions, which the trace at T/cp counts."""
    if s.cp == 1 or s.cp_mode == "ulysses":
        return 0.0
    act_bytes = 4.0 if s.precision == "fp32" else low.itemsize
    return 2.0 * s.micro_batch * (s.seq_len - s.local_seq_len) * kv_width(model) / s.tp * act_bytes


def engine_buffers(model: ModelSpec, s: Setup) -> float:
    """Bytes the engine holds besides model states: gathered units, communication buckets."""
    row = TABLE[s.strategy]
    n_params = model.counts().total
    weight_bytes = _state_bytes_per_param(s.strategy, s.precision)[0]
    block_params = model.counts().block
    root_params = n_params - model.n_blocks * block_params
    # Under expert parallel a block's gathered experts are this rank's E/ep only.
    per_block, in_all = ungathered(model, s)
    if row.buffers == "fsdp_units" and s.pp > 1:
        return gathered_stage_bytes(rank_share(model, s.pp, s.pp_schedule, s.seq_len)[0] - in_all, s.precision)
    if row.buffers == "fsdp_units":
        gathered = 2 if s.precision != "fp32" else 4  # MixedPrecisionPolicy param dtype
        # train.float8 gathers its Linear layers' weights at 1 byte (planning/float8.py).
        if not s.reshard_after_forward:  # every unit stays gathered until its backward
            return float((n_params - in_all) * gathered - buffer_saving(model, s, gathered, all_units=True))
        # Root unit gathered throughout, plus the current and the prefetched block.
        return float((root_params + 2 * (block_params - per_block)) * gathered - buffer_saving(model, s, gathered, False))
    if row.buffers == "zero3_gather":
        # DeepSpeed gathers per module; its estimator: 4 bytes x the largest layer. Plus the
        # gradient reduce bucket: stage3.py's __init__ allocates one per communication dtype
        # (the weights' dtype: bf16 in bf16 runs), at the full reduce_bucket_size whatever the
        # model's size, and keeps it for the whole run.
        return float(4 * model.counts().largest + s.bucket_size * weight_bytes)
    if row.buffers == "buckets":
        # ZeRO-1/2 (stage_1_and_2.py, setup_buckets): each backward's first gradient hook
        # allocates the reduce bucket with torch.empty at the full reduce_bucket_size, no min()
        # with the model's or the partition's size, in _gradient_reduction_buffer_dtype(): the
        # weights' dtype (grad_accum_dtype defaults to it); with overlap_comm (stage 2) a second
        # one to double-buffer, allocated even when the first is never filled. The epilogue
        # (independent_gradient_partition_epilogue -> _release_ipg_buffers) frees them at the
        # end of backward: estimate() counts them in backward's phases only.
        return float(s.bucket_size * weight_bytes * row.bucket_copies)
    return 0.0
