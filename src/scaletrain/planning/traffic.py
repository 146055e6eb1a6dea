"""The bytes each rank moves per optimizer step over the data-parallel ranks and tensor
parallel's, and how many collectives carry them: what the plan reports as traffic and
what the clock (clock/engines.py) prices.
"""

from __future__ import annotations

from scaletrain.models.spec import ModelSpec
from scaletrain.planning.experts import sharded_traffic, tp_split
from scaletrain.planning.float8 import gather_saving
from scaletrain.planning.memory import muon_gather_bytes, trainable_share
from scaletrain.planning.pipeline import rank_share
from scaletrain.planning.setup import Setup
from scaletrain.strategies import TABLE


def tp_comm_bytes_per_step(model: ModelSpec, s: Setup, grad_accum: int) -> float:
    """Tensor parallel: per block two all-reduces of the [tokens, hidden] activations in
    forward and two in backward (with sequence parallel: reduce-scatter + all-gather, the
    same bytes), for every micro-batch; each device sends 2 (tp-1)/tp of the buffer."""
    if s.tp == 1:
        return 0.0
    act_bytes = 4 if s.precision == "fp32" else 2
    buffer = s.micro_batch * s.seq_len * model.hidden_size * act_bytes
    return rank_blocks(model, s) * grad_accum * 4 * 2 * (s.tp - 1) / s.tp * buffer


def rank_blocks(model: ModelSpec, s: Setup) -> int:
    """The blocks this rank runs: all of them, or under a pipeline its stages' only."""
    return rank_share(model, s.pp, s.pp_schedule, s.seq_len)[1]


def tp_collectives(model: ModelSpec, s: Setup) -> int:
    """Per step: per block and micro-batch two in forward and two in backward, doubled
    with sequence parallel (each all-reduce becomes a reduce-scatter and an all-gather)."""
    return rank_blocks(model, s) * s.grad_accum * 4 * (2 if s.sequence_parallel else 1)


def comm_bytes_per_step(model: ModelSpec, s: Setup, grad_accum: int) -> float:
    """Bytes each device sends per optimizer step over the data-parallel dimension (ring
    collectives: (n-1)/n of the buffer); each tp rank moves its 1/tp of the states, each
    pipeline rank those of its stages."""
    n = s.reduce_ranks
    if n == 1:
        return 0.0
    psi = rank_share(model, s.pp, s.pp_schedule, s.seq_len)[0] * tp_split(model, s)
    # Gradients (and ZeRO-1/2's updated weights) exist for the trained parameters only.
    train = psi * trainable_share(model)
    ring = (n - 1) / n
    row = TABLE[s.strategy]
    grad_bytes = 4 if row.fp32_module or s.precision == "fp32" else 2  # torch engines reduce in fp32
    param_bytes = 4 if s.precision == "fp32" else 2
    if row.partitions == 0:
        return 2 * ring * train * grad_bytes  # all-reduce = reduce-scatter + all-gather
    if row.partitions < 3:
        return ring * train * (grad_bytes + param_bytes)  # reduce-scatter grads, all-gather updated params
    # Partitioned parameters (zero3, fsdp): all-gathered in forward and again in backward
    # for every micro-batch (unless kept gathered: shard-grad-op), gradients
    # reduce-scattered once. Under a pipeline a stage stays gathered for the step: one gather.
    gathers = 1 if s.pp > 1 else grad_accum * (1 if (row.keeps_gathered and not s.reshard_after_forward) else 2)
    shard = s.shard
    muon = muon_gather_bytes(model, s, psi)
    if s.ep > 1:  # each rank's experts over the ranks holding the same ones (planning/experts.py)
        total = sharded_traffic(model, s, psi, trainable_share(model), gathers, param_bytes, grad_bytes) + muon
    else:
        gathered = psi * param_bytes - gather_saving(model, s, param_bytes)  # train.float8: its weights at 1 byte
        total = (shard - 1) / shard * (gathered * gathers + train * grad_bytes) + muon
    if s.dp_replicate > 1:  # hybrid: all-reduce the gradient shards across replicas (under ep too: psi / shard each)
        r = s.dp_replicate
        total += 2 * (r - 1) / r * train / shard * grad_bytes
    return total
