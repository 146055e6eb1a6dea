"""What each parallel strategy is and can do, in one table, without torch.

Every part of scaletrain that once compared `parallel.strategy` with a name asks a row of
this table instead: the config's checks (what combines with what), the layout (which
data-parallel axis), the planner (which candidates exist, the memory and communication
terms), the replica guard, checkpoint formats, the CLI's choices and diagnose's advice.
The engines themselves are code (scaletrain/engines/<row.engine>.py); their names appear
here and in their own modules only. A new strategy is one row here plus, if no existing
engine runs it, one engine module.

The memory model (planning/memory.py) follows the ZeRO paper (arXiv 1910.02054): `partitions`
is its stage, what is split over the data-parallel shard group: 0 nothing (DDP), 1 the
optimizer states, 2 also the gradients, 3 also the parameters (ZeRO-3 and FSDP alike). The
other memory fields say what each engine really stores and holds besides (measured on
both engines: docs/planner.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from scaletrain.errors import UserError

Offload = Literal["cpu", "nvme"]


@dataclass(frozen=True)
class Format:
    """What a strategy's native checkpoint save writes (checkpoint/formats.py reads them)."""

    name: str
    # Loading onto another world size or another strategy of the same format is the
    # format's own native load (DCP reshards by byte ranges); otherwise a checkpoint moves
    # through the engine-neutral state (checkpoint/restore.py).
    reshards: bool
    reader: str  # what reads it offline, for messages
    background: bool = False  # a save can return once the state is copied (checkpoint.async_save)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("dcp", reshards=True, reader="torch.distributed.checkpoint", background=True),
        Format("deepspeed", reshards=False, reader="DeepSpeed's universal-checkpoint converter"),
    )
}


@dataclass(frozen=True)
class Strategy:
    name: str  # parallel.strategy
    engine: str  # the module scaletrain.engines.<engine> that runs it
    format: str  # FORMATS key: what its native save writes
    # Where its data-parallel ranks sit in ParallelDims: "replicate" (every rank a whole
    # replica) or "shard" (one group partitioning the states; with `hybrid`, groups of
    # dp / parallel.dp_replicate that replicate across).
    dp_axis: Literal["replicate", "shard"]
    # Data-parallel ranks hold identical whole weights after every step: what the replica
    # guard compares (resilience/weights.py); sharded parameters differ by design.
    whole_replicas: bool
    doc: str  # one line for --help and messages

    # What it combines with. Each is checked when the config loads (config/schema.py).
    tp: bool = False  # parallel.tp > 1 (DTensor tensor parallel under FSDP2)
    pp: bool = False  # parallel.pp > 1 (pipeline stages, each sharded by FSDP2)
    hybrid: bool = False  # parallel.dp_replicate > 1 (hybrid sharding)
    # parallel.ep > 1: a mixture of experts' experts split over ep of the data-parallel
    # ranks, tokens sent to them by all-to-all (engines/expert_parallel.py); the expert
    # weights sharded over the data-parallel ranks that remain.
    ep: bool = False
    no_ep_why: str = ""  # why a strategy without ep has none, for the refusal
    # parallel.cp > 1: each sequence split over cp ranks, keys and values all-gathered
    # (models/context_parallel.py); the gradient reduced over dp x cp.
    cp: bool = False
    no_cp_why: str = ""
    keeps_gathered: bool = False  # parallel.reshard_after_forward=false (weights gathered from forward to backward)
    compile: bool = False  # train.compile (checked with these engines only)
    # train.float8: the blocks' Linear layers as torchao Float8Linear (engines/float8.py),
    # converted on the meta model before the engine wraps it.
    float8: bool = False
    no_float8_why: str = ""  # why a strategy without it has none, for the refusal
    teacher: bool = True  # model.teacher (engines/teacher.py holds it like the model)
    # fault_tolerance.groups > 1: replica groups of this layout, gradients averaged across
    # the live groups by torchft between backward and the optimizer step (resilience/replica_groups.py).
    replica_groups: bool = False
    no_replica_groups_why: str = ""
    grad_compression: bool = False  # parallel.grad_compression (DDP communication hooks)
    # train.spikes: the gradient norm is known on the device before the optimizer step, which
    # a flag there can hold back (torch's optimizers); DeepSpeed's step does both in one call.
    holds_back: bool = False
    deepspeed_json: bool = False  # parallel.deepspeed_extra (merged into its generated DeepSpeed JSON)
    offload_optimizer: tuple[Offload, ...] = ()  # accepted parallel.offload_optimizer besides none
    offload_params: tuple[Offload, ...] = ()  # accepted parallel.offload_params besides none

    # The planner's terms (planning/memory.py, planning/planner.py).
    partitions: int = 0  # ZeRO stage: 0 none, 1 optimizer, 2 + gradients, 3 + parameters
    # The module's weights and gradients stay fp32 (autocast or a mixed-precision policy
    # casts for compute; the reduction is fp32); else 16-bit module weights beside fp32
    # masters inside the optimizer (DeepSpeed).
    fp32_module: bool = True
    # Under bf16/fp16 the forward runs "autocast" (fp32 weights, matmuls cast on the fly)
    # or "pure16" (16-bit weights and activations). planning/activations.py traces either.
    forward16: Literal["autocast", "pure16"] = "pure16"
    optimizer_bytes: float = 8.0  # per trained parameter: AdamW's moments, + DeepSpeed's fp32 master (12)
    fp32_grads: bool = True  # gradients held in fp32 (ZeRO-3 reduces into an fp32 partition; ZeRO-1/2 keep the weights' dtype)
    # ZeRO-1/2 flatten their gradient partition into fp32 for the optimizer step.
    fp32_grad_partition: bool = False
    # Gradients that outlive zero_grad: "distributed" for DDP's bucket views (a wrapper
    # exists only at world > 1), "always" for ZeRO-3's flat gradient partition, "never"
    # otherwise (ZeRO-1/2 free their partition in backward's epilogue and step()).
    grads_persist: Literal["never", "always", "distributed"] = "never"
    # What the engine holds besides model states: FSDP's gathered units, ZeRO-3's gathered
    # module plus its reduce bucket (resident), ZeRO-1/2's reduce buckets (copies: 2 with
    # overlap_comm), which exist only from backward's first gradient to its end.
    buffers: Literal["none", "fsdp_units", "zero3_gather", "buckets"] = "none"
    bucket_copies: int = 0
    # Tensors below DeepSpeed's stage3_param_persistence_threshold stay whole on every rank.
    persistence_threshold: int = 0
    # How a frozen teacher is held (engines/teacher.py): a full copy in the compute dtype,
    # FSDP units of its own, or ZeRO-3 partitions.
    teacher_holding: Literal["replicated", "fsdp_units", "zero3_partitions"] = "replicated"
    # The planner's candidates: the plain setup, and these (offload_optimizer,
    # offload_params) variants; `complexity` orders equally fast ones (fewer moving parts first).
    planned_offloads: tuple[tuple[str, str], ...] = ()
    complexity: int = 0

    # diagnose's advice (diagnose/findings.py).
    comm_advice: str = ""  # when communication takes much of the step
    less_memory: str = ""  # what to try when memory runs short

    def accepts_offload(self, optimizer: str, params: str) -> bool:
        return (optimizer == "none" or optimizer in self.offload_optimizer) and (
            params == "none" or params in self.offload_params
        )


_BUCKETS = "ZeRO-1/2 reduce in buckets: a larger parallel.bucket_size means fewer, longer collectives"

TABLE: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "ddp",
            engine="ddp",
            format="dcp",
            dp_axis="replicate",
            whole_replicas=True,
            doc="torch DDP: every rank a whole replica, gradients all-reduced",
            compile=True,
            float8=True,
            holds_back=True,
            grad_compression=True,
            no_ep_why="DDP keeps every weight whole on every rank, and split experts are not",
            cp=True,
            replica_groups=True,
            forward16="autocast",
            grads_persist="distributed",
            complexity=0,
            comm_advice="DDP all-reduces gradients once per optimizer step (not per micro-batch), so train.grad_accum "
            "divides its cost",
            less_memory="fsdp or zero3",
        ),
        Strategy(
            "fsdp",
            engine="fsdp",
            format="dcp",
            dp_axis="shard",
            whole_replicas=False,
            doc="torch FSDP2: parameters, gradients and optimizer state sharded; tp, pp, hybrid sharding and expert parallel",
            tp=True,
            pp=True,
            hybrid=True,
            ep=True,
            cp=True,
            replica_groups=True,
            keeps_gathered=True,
            compile=True,
            float8=True,
            holds_back=True,
            offload_params=("cpu",),
            partitions=3,
            buffers="fsdp_units",
            teacher_holding="fsdp_units",
            complexity=3,
            comm_advice="FSDP all-gathers weights in forward and again in backward: parallel.reshard_after_forward=false "
            "skips the second gather (weights stay gathered: more memory); across nodes parallel.dp_replicate=<nodes> "
            "shards within a node",
            less_memory="fsdp with parallel.offload_params=cpu",
        ),
        *(
            Strategy(
                f"zero{stage}",
                engine="deepspeed",
                format="deepspeed",
                dp_axis="shard",
                whole_replicas=stage < 3,
                doc=f"DeepSpeed ZeRO-{stage}: "
                + ("optimizer state", "optimizer state and gradients", "parameters, gradients and optimizer state")[stage - 1]
                + " partitioned",
                deepspeed_json=True,
                # DeepSpeed's own expert parallel is its deepspeed.moe.layer.MoE: one module
                # per expert and its own gate (capacity-bound, second expert sampled), a
                # model other than ours with other numbers; and its engine refuses it under
                # ZeRO-3 (runtime/engine.py: "Native DeepSpeed MoE is not supported with ZeRO Stage 3").
                no_ep_why="DeepSpeed's expert parallel needs its own MoE layer (one module per expert, its own "
                "capacity-bound gate; refused under ZeRO-3), not scaletrain's",
                # parallel.cp: DeepSpeed's data-parallel group is every rank, so its
                # reduction runs over dp x cp with nothing of DeepSpeed's own (engines/deepspeed.py).
                cp=True,
                # DeepSpeed holds the module's weights as its own 16-bit (ZeRO-3: partitioned)
                # tensors and casts them itself; torchao's float8 weight casts have no place there.
                no_float8_why="DeepSpeed holds and casts the weights itself (ZeRO-3 partitions them); torchao's float8 "
                "Linear is not wired into it",
                # The all-reduce across groups must sit between backward and the optimizer
                # step; DeepSpeed's engine.step() reduces, clips and steps in one call.
                no_replica_groups_why="DeepSpeed's engine reduces, clips and steps in one call, with no place for "
                "torchft's all-reduce across groups between them",
                offload_optimizer=("cpu", "nvme"),
                offload_params=("cpu", "nvme") if stage == 3 else (),
                partitions=stage,
                fp32_module=False,
                optimizer_bytes=12.0,
                fp32_grads=stage == 3,
                fp32_grad_partition=stage < 3,
                grads_persist="always" if stage == 3 else "never",
                buffers="zero3_gather" if stage == 3 else "buckets",
                bucket_copies=2 if stage == 2 else 1,  # overlap_comm (stage 2) double-buffers
                persistence_threshold=100_000 if stage == 3 else 0,
                teacher_holding="zero3_partitions" if stage == 3 else "replicated",
                planned_offloads={1: (), 2: (("cpu", "none"),), 3: (("cpu", "none"), ("cpu", "cpu"))}[stage],
                complexity={1: 1, 2: 2, 3: 4}[stage],
                comm_advice=_BUCKETS
                if stage < 3
                else "ZeRO-3 gathers every layer's weights in forward and backward: if the model states fit, zero2 or "
                "fsdp with parallel.reshard_after_forward=false communicate less",
                less_memory={1: "zero2 or zero3", 2: "zero3", 3: "zero3 with parallel.offload_optimizer=cpu"}[stage],
            )
            for stage in (1, 2, 3)
        ),
    )
}

STRATEGIES: tuple[str, ...] = tuple(TABLE)  # parallel.strategy's values (besides auto)


def strategy(name: str) -> Strategy:
    """The row of `name`; a one-line UserError naming the accepted ones otherwise."""
    if name not in TABLE:
        raise UserError(f"unknown parallel.strategy {name!r}; accepted: {', '.join(STRATEGIES)}")
    return TABLE[name]


def names_where(capable: Callable[[Strategy], bool]) -> tuple[str, ...]:
    """The strategies with a capability, in table order: for messages and choices."""
    return tuple(s.name for s in TABLE.values() if capable(s))


def said(names: tuple[str, ...]) -> str:
    """('zero1', 'zero2', 'zero3') -> 'zero1, zero2 or zero3'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
