"""What each engine and layout adds to a step beside the model's own compute: the engine's
copies and casts (device work in forward and backward), the optimizer's step, each
collective at the device's rates and the share of it no compute hides, and offload.

Read from the engines' code (torch 2.13, DeepSpeed 0.19.8):
- FSDP2 (`_fsdp_collectives.py`): before each all-gather a unit's shards are cast to the
  compute dtype and copied into one flat buffer; after it, copied out into the unsharded
  parameters. Gradients are concatenated into one buffer (`_chunk_cat`) before the
  reduce-scatter and the reduced shard is added into the fp32 sharded gradient. With
  gradient accumulation only the last micro-batch reduces (engines/fsdp.py). Each unit's
  gather is prefetched while the unit before computes.
- DDP: gradients all-reduced in fp32 buckets during the backward of the last micro-batch.
- DeepSpeed ZeRO-1/2: each gradient is copied into the reduce bucket as it is made and the
  bucket reduced (overlapped with backward under stage 2's overlap_comm); the step
  flattens the partition to fp32, runs Adam on it, copies the fp32 master back into the
  16-bit weights and all-gathers them. ZeRO-3 gathers and releases module by module, like
  FSDP's units, from 16-bit partitions.
- tensor parallel: per block two collectives in forward and two in backward (doubled under
  sequence parallel), between matmuls: exposed. Pipelines: each stage boundary sends the
  activations forward and their gradients back, per micro-batch: exposed. Context
  parallel: per block the keys' and values' gathers (Ulysses: four all-to-alls) before
  attention: exposed. Expert parallel: the routed tokens' all-to-alls: exposed.

Hiding: on a GPU a collective runs on its own stream beside the compute it overlaps (a
unit's gather beside the previous unit's compute; DDP's and ZeRO-2's reductions beside
the rest of backward), so only what exceeds that compute is exposed. On a CPU the same
cores run the collective's copies and reductions and the compute: nothing is hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from scaletrain.models.spec import ModelSpec
from scaletrain.optim.registry import optimizer
from scaletrain.planning.clock.compute import MicroBatch
from scaletrain.planning.clock.rates import Rates
from scaletrain.planning.context import cp_comm_bytes_per_step
from scaletrain.planning.experts import a2a_bytes_per_step, a2a_collectives, off_node_share, ungathered
from scaletrain.planning.float8 import cast_bytes, converted
from scaletrain.planning.hardware import Device
from scaletrain.planning.memory import offloaded_activations, trainable_share
from scaletrain.planning.pipeline import pp_comm_bytes_per_step, rank_share
from scaletrain.planning.setup import Setup
from scaletrain.planning.traffic import rank_blocks, tp_collectives, tp_comm_bytes_per_step
from scaletrain.strategies import TABLE

DDP_BUCKET = 25 * 2**20  # torch DDP's bucket_cap_mb default
CPU_ADAM_PARAMS_PER_S = 1e9  # DeepSpeedCPUAdam on a node's cores, order of magnitude (no CPU table for it yet)


@dataclass
class EngineWork:
    forward: float = 0.0  # device work added to forward (the engine's copies and casts, exposed gathers are comm)
    backward: float = 0.0
    optimizer: float = 0.0
    comm: float = 0.0  # exposed communication
    offload: float = 0.0
    largest: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, phase: str, label: str, seconds: float) -> None:
        if seconds <= 0:
            return
        setattr(self, phase, getattr(self, phase) + seconds)
        self.largest.setdefault(phase, []).append((label, seconds))


def engine_work(model: ModelSpec, s: Setup, rates: Rates, mb: MicroBatch, per_node: int, nodes: int) -> EngineWork:
    work = EngineWork()
    row = TABLE[s.strategy]
    # Where the group the engine's collectives run over spans nodes, its ranks on each node (tp
    # innermost: each node holds per_node / tp of them), which ring collectives use that many NICs
    # for (Rates.collective). A sharding engine's group is one copy's shard group (hybrid: the
    # replicas outermost, so a shard group inside a node gathers over NVLink); ddp's all of dp.
    group = s.shard if row.partitions else s.reduce_ranks
    inter = max(1, per_node // s.tp) if group * s.tp > per_node else 0
    params = rank_share(model, s.pp, s.pp_schedule, s.seq_len)[0] / s.tp
    train = params * trainable_share(model)
    low = 4 if s.precision == "fp32" else 2
    n = s.shard
    _optimizer(work, model, s, rates, row.partitions, train, low)
    if row.partitions == 3 and row.buffers == "fsdp_units":
        _fsdp(work, model, s, rates, mb, params, train, low, inter)
    elif row.partitions == 3:
        _zero3(work, model, s, rates, mb, params, train, low, inter)
    elif row.partitions > 0:
        _zero12(work, s, rates, mb, params, train, low, inter)
    elif s.reduce_ranks > 1:
        _ddp(work, s, rates, mb, train, inter)
    if s.dp_replicate > 1:  # hybrid: the gradient shards all-reduced across the replicas
        t = rates.collective("all_reduce", 4 * train / n, s.dp_replicate, True)
        work.add("comm", f"hybrid all-reduce over {s.dp_replicate} replicas", t)
    _hooks(work, model, s, rates, mb)
    _model_parallel(work, model, s, rates, per_node, nodes)
    _offload(work, model, s, rates, mb, train, low)
    for phase in list(work.largest):
        work.largest[phase] = sorted(work.largest[phase], key=lambda x: -x[1])[:5]
    return work


def _hooks(work: EngineWork, model: ModelSpec, s: Setup, rates: Rates, mb: MicroBatch) -> None:
    """The engine's own host work per unit it wraps, as measured on a model too small to
    compute (rates.engine): FSDP per block and root, DeepSpeed and DDP (several ranks) per
    parameter tensor."""
    per = rates.engine(s.strategy)
    if not TABLE[s.strategy].partitions and s.reduce_ranks == 1:
        return  # the plain engine wraps nothing at one rank
    if not per:
        if TABLE[s.strategy].partitions and rates.kind == "cpu":
            work.notes.append(f"{s.strategy}'s own cost per unit is not calibrated on this machine (scaletrain plan --calibrate)")
        elif TABLE[s.strategy].partitions and rates.measured:  # an unmeasured kind's note says so already
            work.notes.append(
                f"{s.strategy}'s own host work per unit (its hooks) is not in the {rates.kind} table: left out "
                "(scaletrain plan --calibrate on such a GPU measures it)"
            )
        return
    fsdp = TABLE[s.strategy].buffers == "fsdp_units"
    units = (model.n_blocks + 1) / s.pp if fsdp else len(model.counts().numels) / s.pp
    what = "each block and the root" if fsdp else "each parameter tensor"
    hooks = units * per["forward_backward_s"] / 2  # per pass of a micro-batch
    for phase, host, took in (("forward", mb.host_forward, mb.forward), ("backward", mb.host_backward, mb.backward)):
        # A GPU's host queues kernels ahead: its hooks cost the step only where the host's work,
        # theirs added, outlasts the pass's kernels (a small model's step; a large one hides them).
        shows = max(0.0, host + hooks - took) if rates.asynchronous else hooks
        work.add(phase, f"{s.strategy}'s hooks on {what}", s.grad_accum * shows)
    work.add("optimizer", f"{s.strategy}'s step beyond AdamW's, on {what}", units * per["step_s"])


def _hidden(rates: Rates, collective: float, beside: float) -> float:
    """What of `collective` seconds shows when `beside` seconds of compute run with it."""
    return collective if not rates.asynchronous else max(0.0, collective - beside)


def _optimizer(work: EngineWork, model: ModelSpec, s: Setup, rates: Rates, partitions: int, train: float, low: int) -> None:
    if s.offload_optimizer != "none":
        return  # _offload: the host's Adam
    share = train / s.shard if partitions >= 1 else train
    tensors = len(model.counts().numels)
    if TABLE[s.strategy].deepspeed_json:
        # One flat fp32 partition, its gradient flattened and converted, the master copied back to the 16-bit weights.
        work.add("optimizer", f"AdamW over the flat partition ({share / 1e6:.3g}M parameters)", rates.optimizer(share, 1))
        work.add(
            "optimizer",
            "the partition's gradient flattened to fp32, the master cast back",
            rates.copy(share * (3 * low + 4 + 4 + low)),
        )
    else:
        work.add(
            "optimizer", f"AdamW and clipping ({share / 1e6:.3g}M parameters, {tensors} tensors)", rates.optimizer(share, tensors)
        )
    if partitions and s.reduce_ranks > 1:
        # The gradient norm of sharded gradients: each rank's sum of squares all-reduced (clipping).
        work.add("optimizer", "the gradient norm's all-reduce", rates.collective("all_reduce", 8.0, s.reduce_ranks, False))
    if note := optimizer(s.optimizer).clock_note:  # optim/registry.py: where the clock prices it as another
        work.notes.append(f"train.optimizer={s.optimizer}: {note}")


def _ddp(work: EngineWork, s: Setup, rates: Rates, mb: MicroBatch, train: float, inter: int) -> None:
    n = s.reduce_ranks
    total = 4.0 * train
    buckets = max(1, int(total // DDP_BUCKET) + (total % DDP_BUCKET > 0))
    t = buckets * rates.collective("all_reduce", total / buckets, n, inter)
    last = rates.collective("all_reduce", min(total, DDP_BUCKET), n, inter)
    shown = max(last, _hidden(rates, t, mb.backward)) if rates.asynchronous else t
    work.add("comm", f"DDP's gradient all-reduce ({total / 2**20:.0f} MiB fp32 in {buckets} buckets)", shown)


def _fsdp(
    work: EngineWork, model: ModelSpec, s: Setup, rates: Rates, mb: MicroBatch, params: float, train: float, low: int, inter: int
) -> None:
    n = s.shard
    blocks = model.n_blocks / s.pp
    unit = model.counts().block / s.tp - ungathered(model, s)[0]
    root = max(0.0, params - blocks * model.counts().block / s.tp)
    gathers = 1 if (s.pp > 1 or not s.reshard_after_forward) else 2
    m = s.grad_accum
    per_gather = 1 if s.pp > 1 else m

    # Copies per gather of a unit of u parameters: the shards cast to the compute dtype (read
    # 4, write `low`) and copied in (read and write `low`), the whole copied out (the same).
    def copies(u: float) -> float:
        return u / n * (4 + low) * (low < 4) + u / n * 2 * low + u * 2 * low

    gather_copy = rates.copy(copies(unit)) * blocks + rates.copy(copies(root))
    work.add("forward", "FSDP's gather copies and casts", gather_copy * per_gather)
    if gathers == 2:
        work.add("backward", "FSDP's gather copies and casts (backward)", gather_copy * per_gather)
    # The gradients: concatenated (read and write 4), reduced, added into the fp32 shard.
    reduce_copy = rates.copy(unit * 8 + unit / n * 12) * blocks + rates.copy(root * 8 + root / n * 12)
    work.add("backward", "FSDP's gradient copies into and out of the reduce-scatter", reduce_copy)
    if n == 1:
        return
    g_unit = rates.collective("all_gather", unit * low, n, inter)
    g_root = rates.collective("all_gather", root * low, n, inter)
    rs_unit = rates.collective("reduce_scatter", unit * 4, n, inter)
    rs_root = rates.collective("reduce_scatter", root * 4, n, inter)
    per_block_f = mb.forward / max(1.0, blocks)
    per_block_b = mb.backward / max(1.0, blocks)
    fwd = g_root + g_unit + blocks * _hidden(rates, g_unit, per_block_f)
    bwd = blocks * _hidden(rates, g_unit, per_block_b) if gathers == 2 else 0.0
    grads = rs_root + blocks * _hidden(rates, rs_unit, per_block_b)
    work.add(
        "comm", f"FSDP's all-gathers ({unit * low / 2**20:.1f} MiB a block, {gathers} per micro-batch)", (fwd + bwd) * per_gather
    )
    work.add("comm", f"FSDP's gradient reduce-scatters ({unit * 4 / 2**20:.1f} MiB a block)", grads)


def _zero3(
    work: EngineWork, model: ModelSpec, s: Setup, rates: Rates, mb: MicroBatch, params: float, train: float, low: int, inter: int
) -> None:
    n = s.shard
    blocks = model.n_blocks
    unit = model.counts().block
    m = s.grad_accum
    # Each module's partitions gathered into its 16-bit weights before forward and again before backward, released after.
    copy = rates.copy(params * 2 * low)
    work.add("forward", "ZeRO-3's gathers into the modules' weights", copy * m)
    work.add("backward", "ZeRO-3's gathers into the modules' weights (backward)", copy * m)
    work.add("backward", "ZeRO-3's gradient buckets and the fp32 partition", rates.copy(train * (2 * low + 8)) * m)
    if n == 1:
        return
    g = rates.collective("all_gather", unit * low, n, inter)
    rs = rates.collective("reduce_scatter", unit * low, n, inter)
    per_block_f, per_block_b = mb.forward / blocks, mb.backward / blocks
    work.add("comm", "ZeRO-3's all-gathers", m * blocks * (_hidden(rates, g, per_block_f) + _hidden(rates, g, per_block_b)))
    work.add("comm", "ZeRO-3's gradient reduce-scatters", m * blocks * _hidden(rates, rs, per_block_b))


def _zero12(work: EngineWork, s: Setup, rates: Rates, mb: MicroBatch, params: float, train: float, low: int, inter: int) -> None:
    n = s.shard
    m = s.grad_accum
    # Each gradient copied into the reduce bucket as it is made, the reduced bucket into the partition.
    work.add("backward", "ZeRO's gradient buckets", rates.copy(train * 2 * low + train / n * 2 * low) * m)
    if n == 1:
        return
    reduce = rates.collective("reduce_scatter", train * low, n, inter)
    shown = reduce if TABLE[s.strategy].partitions < 2 else _hidden(rates, reduce, mb.backward)
    work.add("comm", f"ZeRO's gradient reduction ({train * low / 2**20:.0f} MiB)", shown)
    # Inside DeepSpeed's step (telemetry's optimizer phase): the updated weights gathered.
    work.add("optimizer", "ZeRO's all-gather of the updated weights", rates.collective("all_gather", params * low, n, inter))


def _model_parallel(work: EngineWork, model: ModelSpec, s: Setup, rates: Rates, per_node: int, nodes: int) -> None:
    if s.tp > 1:
        count = tp_collectives(model, s)
        total = tp_comm_bytes_per_step(model, s, s.grad_accum)  # what each rank sends: 2 (tp-1)/tp of the buffers
        buffer = total / (rank_blocks(model, s) * s.grad_accum * 4) / (2 * (s.tp - 1) / s.tp)
        across = per_node if s.tp > per_node else 0  # a node's ranks all in the group
        if s.sequence_parallel:  # each all-reduce an all-gather and a reduce-scatter: half of each
            t = (
                count
                / 2
                * (
                    rates.collective("all_gather", buffer, s.tp, across)
                    + rates.collective("reduce_scatter", buffer, s.tp, across)
                )
            )
        else:
            t = count * rates.collective("all_reduce", buffer, s.tp, across)
        work.add("comm", f"tensor parallel's {count} collectives ({buffer / 2**20:.1f} MiB each)", t)
        _tp_ends(work, model, s, rates, buffer, across)
    if s.pp > 1:
        sent = pp_comm_bytes_per_step(model, s)
        sends = 2 * s.grad_accum * (sent and 1) * _stages_per_rank(s)
        across = s.dp * s.tp >= per_node and nodes > 1
        t = sends * rates.collective("send", sent / max(1, sends), 2, across)
        work.add("comm", f"the pipeline's {sends} sends of activations and their gradients", t)
    if s.cp > 1:
        cp_bytes = cp_comm_bytes_per_step(model, s)
        passes = 3 if s.activation_checkpointing else 2
        per = (4 if s.cp_mode == "ulysses" else 2) * rank_blocks(model, s) * s.grad_accum * passes // 2
        kind = "all_to_all" if s.cp_mode == "ulysses" else "all_gather"
        ring = (s.cp - 1) / s.cp
        across = max(1, per_node // s.tp) if s.cp * s.tp > per_node else 0
        t = per * rates.collective(kind, cp_bytes / max(1, per) / ring, s.cp, across)
        work.add("comm", f"context parallel's {per} {kind.replace('_', '-')}s", t)
    if s.ep > 1:
        sent = a2a_bytes_per_step(model, s)
        count = a2a_collectives(model, s)
        off = off_node_share(s.ep, per_node)
        exchanges = max(1, count * 4 // 5)  # of the collectives, those carrying slots (the rest exchange their counts)
        full = sent / exchanges * s.ep / (s.ep - 1)
        t = count * rates.latency(off > 0) + exchanges * (
            rates.collective("all_to_all", full, s.ep, off > 0) - rates.latency(off > 0)
        )
        work.add("comm", f"expert parallel's {count} all-to-alls ({sent / 2**30:.2f} GiB a step)", t)


def _tp_ends(work: EngineWork, model: ModelSpec, s: Setup, rates: Rates, buffer: float, across: int) -> None:
    """Tensor parallel's collectives beyond the blocks' (models/llama_tp.py; each seen in a
    profiled tp 2 run's trace): the embedding's output reduced (a reduce-scatter with sequence
    parallel, gathered back in backward) and the head's input gathered (its gradient reduced
    in backward), one of each per micro-batch on the stages holding them; and small
    all-reduces, each about a collective's start-up: loss parallel's three per chunk of the
    loss (the logits' max and sum over the vocabulary shards, the picked target's logit), the
    sequence-parallel norms' gradients (partial sums over the tp ranks: one per FSDP unit,
    each block and the root, at the step's gradient sync) and the gradient norm's."""
    ends = s.grad_accum * 2 / s.pp  # the embedding on the first stage, the head on the last
    if s.sequence_parallel:
        big = ends * (
            rates.collective("all_gather", buffer, s.tp, across) + rates.collective("reduce_scatter", buffer, s.tp, across)
        )
    else:
        big = ends * rates.collective("all_reduce", buffer, s.tp, across)
    tokens = s.micro_batch * s.seq_len
    chunks = max(1, math.ceil(tokens / model.loss_chunk_tokens)) if model.loss_chunk_tokens else 1
    losses = 3 * chunks * s.grad_accum / s.pp
    small = losses * rates.collective("all_reduce", tokens / chunks * 4, s.tp, across)  # one fp32 value per token
    units = rank_blocks(model, s) + 1 if s.sequence_parallel else 0
    small += (units + 1) * rates.collective("all_reduce", 2 * model.hidden_size * 4, s.tp, across)
    work.add(
        "comm", f"tensor parallel's {ends * (2 if s.sequence_parallel else 1):g} collectives at the embedding and the head", big
    )
    work.add("comm", f"tensor parallel's {losses + units + 1:g} small all-reduces (the loss, the norms' gradients)", small)


def _stages_per_rank(s: Setup) -> int:
    from scaletrain.config.stages import SCHEDULES

    return SCHEDULES[s.pp_schedule][1]


def _offload(work: EngineWork, model: ModelSpec, s: Setup, rates: Rates, mb: MicroBatch, train: float, low: int) -> None:
    device = rates._device
    host_bw = device.host_bw if device is not None else 10e9
    share = train / s.reduce_ranks
    if s.offload_optimizer != "none":
        work.add("offload", "gradients to the host and weights back", 2 * low * share / host_bw * 2)
        work.add("offload", "DeepSpeedCPUAdam on the host's cores", share / CPU_ADAM_PARAMS_PER_S)
    if s.offload_params != "none":
        work.add("offload", "parameters from the host for every gather", 2 * s.grad_accum * low * share / host_bw)
    if s.activation_offload and rates.asynchronous:
        moved = offloaded_activations(model, s) * s.grad_accum / host_bw
        compute = s.grad_accum * (mb.forward + mb.backward)
        work.add(
            "offload", "saved activations to the host and back", max(0.0, moved - compute / 3) + max(0.0, moved - 2 * compute / 3)
        )


def float8_change(model: ModelSpec, s: Setup, device: Device, rates: Rates, mb: MicroBatch, compiled: bool) -> float:
    """Seconds train.float8 changes a micro-batch by (negative: faster): the converted
    Linear layers' share of the blocks' matmul time at the float8 peak's share of the bf16
    one, and their casts at the memory bandwidth (planning/float8.py counts them)."""
    if not s.float8 or not device.peak_flops_8:
        return 0.0
    share = min(1.0, converted(model).params / max(1.0, model.n_blocks * model.counts().block))
    saved = mb.matmul_s * share * (1 - device.peak_flops_16 / device.peak_flops_8)
    tokens = s.micro_batch * s.local_seq_len
    return rates.copy(cast_bytes(model, replace(s, grad_accum=1), tokens, compiled)) - saved
