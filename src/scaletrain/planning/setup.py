"""What a plan estimates: one strategy at one layout, with the settings memory and time depend on."""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.config import AUTO_MICRO_BATCH, Config
from scaletrain.config.batch import per_rank
from scaletrain.config.parallel import ParallelDims
from scaletrain.models.spec import ModelSpec
from scaletrain.strategies import TABLE


@dataclass(frozen=True)
class Setup:
    """What the memory depends on: one strategy at one data-parallel size."""

    strategy: str  # ddp | fsdp | zero1 | zero2 | zero3
    dp: int  # data-parallel ranks sharing the model states
    micro_batch: int
    seq_len: int
    precision: str  # fp32 | bf16 | fp16
    activation_checkpointing: bool = False
    # parallel.ac_mode=selective: a checkpointed block keeps the outputs models/selective_ac.py
    # names and recomputes the rest (planning/memory.py, clock/compute.py)
    selective: bool = False
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_params: str = "none"
    reshard_after_forward: bool = True
    dp_replicate: int = 1  # fsdp hybrid: states shard over dp / dp_replicate
    bucket_size: int = 50_000_000  # DeepSpeed bucket elements
    grad_accum: int = 1  # micro-batches per optimizer step (time and traffic, not memory)
    tp: int = 1  # tensor parallel (fsdp): every block, the embedding and the head split tp ways
    sequence_parallel: bool = True  # with tp: norms and residual split over the sequence too
    pp: int = 1  # pipeline stages' ranks (fsdp): each holds its stages' blocks (planning/pipeline.py)
    pp_schedule: str = "1f1b"
    # Expert parallel (fsdp, a mixture of experts): each MoE layer's experts split over ep of
    # the shard ranks, their weights sharded over shard / ep (planning/experts.py).
    ep: int = 1
    # Context parallel (ddp, fsdp): each sequence's tokens over cp ranks that read the same
    # samples; keys and values all-gathered per block; the model states shared (FSDP:
    # sharded) over dp x cp (models/context_parallel.py).
    cp: int = 1
    cp_mode: str = "allgather"  # parallel.cp_mode: allgather | ulysses (planning/context.py)
    # train.tile_tokens: the feed-forward over tiles, recomputed (planning/context.py); 0: whole.
    tile_tokens: int = 0
    # train.activation_offload: saved activations held on the host, but the block in flight
    # (planning/memory.py); evaluate() turns it off on a CPU, whose host is its device.
    activation_offload: bool = False
    teacher: ModelSpec | None = None  # model.teacher: a frozen model beside the trained one
    # train.float8: the blocks' Linear layers in float8 (planning/float8.py: their matmuls at the
    # float8 peak, FSDP's all-gathers of their weights at 1 byte).
    float8: bool = False
    # ... and FSDP all-gathers those weights in float8 (over NCCL; gloo has no float8 dtypes:
    # evaluate() turns it off on a CPU, whose units gather them in bf16).
    float8_gather: bool = True
    # train.optimizer: its state per parameter and where it runs are its entry's
    # (optim/registry.py; planning/memory.py, planner.py).
    optimizer: str = "adamw"
    # The planner chose the micro-batch (train.micro_batch=auto, or a smaller one than
    # configured at the same global batch): the label says which.
    searched: bool = False

    @property
    def label(self) -> str:
        parts = [self.strategy]
        if self.offload_optimizer != "none":
            parts.append(f"optim->{self.offload_optimizer}")
        if self.offload_params != "none":
            parts.append(f"params->{self.offload_params}")
        if TABLE[self.strategy].keeps_gathered and not self.reshard_after_forward and self.pp == 1:  # a pipeline always is
            parts.append("shard-grad-op")
        if self.dp_replicate > 1:
            parts.append(f"hybrid {self.dp_replicate}x{self.dp // self.dp_replicate}")
        if self.tp > 1:
            parts.append(f"tp {self.tp}" + ("" if self.sequence_parallel else " (no SP)"))
        if self.pp > 1:
            parts.append(f"pp {self.pp} ({self.pp_schedule})")
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        if self.cp > 1:
            parts.append(f"cp {self.cp}" + (" (ulysses)" if self.cp_mode == "ulysses" else ""))
        if self.tile_tokens:
            parts.append(f"tiles {self.tile_tokens}")
        if self.activation_offload:
            parts.append("activations->cpu")
        if self.float8:
            parts.append("float8")
        if self.activation_checkpointing:
            parts.append("selective AC" if self.selective else "AC")
        if self.searched:
            parts.append(f"micro-batch {self.micro_batch}")
        return " + ".join(parts)

    @property
    def shard(self) -> int:
        """The ranks one copy of the model states is partitioned over (dp without hybrid
        sharding; x cp, whose ranks share the states too)."""
        return self.dp // self.dp_replicate * self.cp

    @property
    def reduce_ranks(self) -> int:
        """The ranks a gradient is reduced over: the data-parallel ones and, under cp, theirs."""
        return self.dp * self.cp

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence one rank holds."""
        return self.seq_len // self.cp

    @classmethod
    def from_config(cls, cfg: Config, dims: ParallelDims, teacher: ModelSpec | None = None) -> Setup:
        """The setup a config runs on the layout `dims` (what train, plan and diagnose estimate)."""
        p = cfg.parallel
        # micro_batch=auto starts from all of a rank's sequences in one micro-batch; the
        # planner searches down from there (planner.py).
        auto = cfg.train.micro_batch == AUTO_MICRO_BATCH
        return cls(
            strategy=p.strategy,
            dp=dims.dp_size,
            micro_batch=per_rank(cfg.train, dims.dp_size) if auto else cfg.train.micro_batch,
            seq_len=cfg.data.seq_len,
            precision=cfg.precision,
            activation_checkpointing=p.activation_checkpointing,
            selective=p.activation_checkpointing and p.ac_mode == "selective",
            offload_optimizer=p.offload_optimizer,
            offload_params=p.offload_params,
            # Under a pipeline FSDP keeps each stage gathered for the step (engines/fsdp.py).
            reshard_after_forward=p.reshard_after_forward and dims.pp == 1,
            dp_replicate=p.dp_replicate,
            bucket_size=p.bucket_size,
            grad_accum=1 if auto else cfg.train.grad_accum,
            tp=dims.tp,
            sequence_parallel=p.sequence_parallel,
            pp=dims.pp,
            pp_schedule=p.pp_schedule,
            ep=dims.ep,
            cp=dims.cp,
            cp_mode=p.cp_mode,
            tile_tokens=cfg.train.tile_tokens,
            activation_offload=cfg.train.activation_offload,
            teacher=teacher,
            float8=cfg.train.float8,
            optimizer=cfg.train.optimizer,
        )
