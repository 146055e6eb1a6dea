"""The run configuration's schema: its sections, keys, types, defaults and ranges, and the checks
across keys (load.py reads YAML files and overrides into it).

One pydantic schema is the single source of the keys, their types, defaults and ranges;
`scaletrain train --print-config` shows the resolved result. Every problem becomes a
UserError whose one line names the key, the bad value and what is accepted.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationInfo, field_serializer, field_validator, model_validator

from scaletrain.config.data import DataConfig, MixSource  # noqa: F401  # re-exported: the schema's data section
from scaletrain.config.eval import EvalConfig
from scaletrain.config.float8 import float8_problem, with_implied_precision
from scaletrain.config.ft import FaultToleranceConfig, fault_tolerance_problem
from scaletrain.config.model import (  # noqa: F401  # re-exported: the schema's model sections
    MODEL_PRESETS,
    MOE_PRESETS,
    LoraSection,
    ModelConfig,
    ModelSource,
    MoeSection,
    Section,
    TeacherConfig,
    compiled_experts_problem,
)
from scaletrain.config.sequences import long_sequence_problem
from scaletrain.config.sources import SOURCES as MODEL_SOURCES
from scaletrain.config.spikes import SpikesSection, spikes_problem
from scaletrain.config.stages import SCHEDULES, compile_problem, schedule_problem
from scaletrain.optim.registry import OPTIMIZERS, layout_problem
from scaletrain.optim.registry import SCHEDULES as LR_SCHEDULES
from scaletrain.optim.registry import accepted as registered
from scaletrain.strategies import STRATEGIES, TABLE, names_where, said

# train.micro_batch=auto before a run resolves it (scaletrain/batch.py).
AUTO_MICRO_BATCH = 0


class ParamGroupSection(Section):
    """One entry of train.param_groups: the parameters whose names match (glob patterns over
    the model's parameter names, e.g. "tok_embeddings.*", "layers.*.feed_forward.router.*"),
    trained at `lr` x the scheduled learning rate, with their own weight decay."""

    match: list[str] = Field(min_length=1)
    lr: float = Field(1.0, gt=0)  # a multiplier of the schedule's learning rate
    weight_decay: float | None = Field(None, ge=0)  # unset: train.weight_decay on matrices, 0 on 1-D parameters


class TrainConfig(Section):
    steps: int = Field(300, ge=1)
    # Sequences per rank per forward: a number, or auto (stored as AUTO_MICRO_BATCH until a
    # run resolves it): the largest the plan fits on this run's devices. A memory setting
    # only: with train.global_batch set, grad_accum follows from it (scaletrain/batch.py).
    micro_batch: int = 16
    grad_accum: int = Field(1, ge=1)
    # Sequences per optimizer step over every data-parallel rank. Unset: micro_batch x
    # grad_accum x the data-parallel size. The numbers a run computes depend on it, not on
    # the micro-batch: auto, the planner's search and an out-of-memory error change the
    # micro-batch and grad_accum at the same global batch.
    global_batch: int | None = Field(None, ge=1)
    # Written by scaletrain into the run's resolved config: why the micro-batch is what it
    # is (auto, the planner's search, an out-of-memory error). Informational; ignored as input.
    batch_choice: str | None = None
    # The cross entropy this many positions at a time (models/loss.py): the fp32 logits
    # and their fp32 gradient never exist whole. 0: all at once (plain torch).
    loss_chunk_tokens: int = Field(0, ge=0)
    # What the forward saves for backward held in host memory until the backward needs it
    # (engines/offload.py; with activation checkpointing: the blocks' inputs).
    activation_offload: bool = False
    # The built-in dense feed-forward over tiles of this many positions, each recomputed in
    # backward (models/feed_forward.py): its hidden activations never exist whole. 0: off.
    tile_tokens: int = Field(0, ge=0)
    # torch.compile each block (inductor; a C++ compiler on CPU). ddp and fsdp; compiled at
    # the first step (tens of seconds on a CPU), then reused by every block.
    compile: bool = False
    # The blocks' Linear layers train in float8 (torchao, tensorwise scales; not the head,
    # embedding or routers): ddp and fsdp, bf16, Ada/Hopper GPUs (config/float8.py, docs/float8.md).
    float8: bool = False
    # SDPA's kernel first in torch's priority (training/attention_kernel.py): auto measures
    # FlashAttention against cuDNN's at the run's shape on a GPU (on a CPU torch's order stays).
    attention_kernel: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    lr: float = Field(3e-3, gt=0, le=10)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # the decay ends at lr * min_lr_ratio
    warmup_steps: int = Field(20, ge=0)
    # After the linear warmup (optim/schedule.py, lr_at; the names: optim/registry.py
    # SCHEDULES): cosine or linear decay over the rest of train.steps; constant; wsd,
    # warmup-stable-decay: lr held until the last train.decay_steps (unset: a fifth of
    # train.steps), then decayed with train.decay_shape (1-sqrt, Hägele et al. 2024, or
    # linear). Only wsd's shape up to its decay does not depend on train.steps: a run can be
    # extended from any of its stable-phase checkpoints. Unset: the optimizer entry's own
    # schedule where it has one, else cosine.
    schedule: str = "cosine"
    decay_steps: int | None = Field(None, ge=1)
    decay_shape: Literal["1-sqrt", "linear"] = "1-sqrt"
    # With train.resume=CKPT (a stable-phase checkpoint of a wsd or constant run) and another
    # run.dir: a cooldown branched from it, N steps of wsd's decay, the original run untouched
    # (training/rundir.py branch_cooldown sets train.steps, schedule and decay_steps).
    cooldown_steps: int | None = Field(None, ge=1)
    weight_decay: float = Field(0.1, ge=0)
    # adamw: torch's AdamW for every parameter. muon: torch's Muon for the 2-D matrices inside
    # the blocks, AdamW for the embedding, the head and the gains, at one train.lr (Muon's
    # updates scaled to AdamW's RMS, as Moonlight does; optim/muon.py). Every name, what it
    # is and where it runs: optim/registry.py OPTIMIZERS; docs/optimizers.md.
    optimizer: str = "adamw"
    # Parameters trained at their own learning rate (a multiplier) and weight decay: the
    # first entry whose patterns match a parameter's name takes it; the rest keep the
    # defaults. A pattern that matches no parameter is an error (optim/optimizers.py).
    param_groups: list[ParamGroupSection] = Field(default_factory=list)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0)  # max global grad norm; 0 disables clipping
    seed: int = Field(1234, ge=0)
    resume: str = "auto"  # auto | never | PATH of a checkpoint directory
    # Stop after this step, a checkpoint written there, while the schedule stays train.steps
    # long (a later run without it goes on as one straight run would); 0: at train.steps.
    # `scaletrain verify` re-runs a stretch of a run with it.
    stop_at: int = Field(0, ge=0)
    log_every: int = Field(10, ge=1)  # steps between metric flushes (one host sync each)
    # Opt-in LR scaling with the effective (global) batch: lr was tuned at lr_base_batch
    # sequences; linear (Goyal et al.) or sqrt (Adam-style) scaling to the batch actually run.
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    lr_base_batch: int | None = Field(None, ge=1)
    # fp16 dynamic loss scaling, the same two numbers for every engine: the first scale (a
    # power of two, as DeepSpeed takes its exponent) and the overflow-free steps after which
    # it doubles. An overflow skips the step and halves the scale (DeepSpeed: its hysteresis
    # of 2 halves at the second overflow in a row, see engines/deepspeed_config.py).
    loss_scale_init: float = Field(65536.0, ge=1, le=2.0**64)
    loss_scale_window: int = Field(1000, ge=1)
    # A step whose loss (any rank) or gradient norm is NaN/inf is never applied: every
    # engine leaves weights and optimizer state as they were (resilience/nonfinite.py). Then: skip
    # (go on with the next batch), rollback (after `nonfinite_patience` bad steps in a
    # row, reload the newest valid checkpoint and go on past the offending data) or
    # abort (stop at the first one). skip also stops after `nonfinite_patience` in a row:
    # a run that only skips is not training.
    nonfinite: Literal["skip", "rollback", "abort"] = "skip"
    nonfinite_patience: int = Field(10, ge=1)
    # Finite loss and gradient-norm spikes (config/spikes.py, resilience/spikes.py): off by default.
    spikes: SpikesSection = Field(default_factory=SpikesSection)

    @model_validator(mode="before")
    @classmethod
    def _optimizers_schedule(cls, data: Any) -> Any:
        """train.schedule left unset: the optimizer's own where its entry has one."""
        if isinstance(data, dict) and "schedule" not in data:
            entry = OPTIMIZERS.get(data.get("optimizer", "adamw"))
            if entry is not None and entry.schedule is not None:
                data = {**data, "schedule": entry.schedule}
        return data

    @field_validator("optimizer", "schedule")
    @classmethod
    def _registered(cls, v: str, info: ValidationInfo) -> str:
        """A name of optim/registry.py's table for the key."""
        table: dict[str, Any] = OPTIMIZERS if info.field_name == "optimizer" else LR_SCHEDULES
        if v not in table:
            raise ValueError(f"train.{info.field_name}={v} is not one scaletrain knows; accepted: {registered(table)}")
        return v

    @field_validator("loss_scale_init")
    @classmethod
    def _power_of_two(cls, v: float) -> float:
        if not math.log2(v).is_integer():
            raise ValueError(f"train.loss_scale_init={v:g} is not a power of two; accepted: 1, 2, 4, ..., e.g. 65536")
        return v

    @field_validator("micro_batch", mode="before")
    @classmethod
    def _auto_or_positive(cls, v: Any) -> Any:
        if v == "auto":
            return AUTO_MICRO_BATCH
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"train.micro_batch={v!r} is invalid; accepted: an integer >= 1, or auto")
        return v

    @field_serializer("micro_batch")
    def _auto_as_written(self, v: int) -> int | str:
        return "auto" if v == AUTO_MICRO_BATCH else v

    @model_validator(mode="after")
    def _auto_needs_a_global_batch(self) -> TrainConfig:
        if self.micro_batch == AUTO_MICRO_BATCH and self.global_batch is None:
            raise ValueError(
                "train.micro_batch=auto needs train.global_batch (sequences per optimizer step): the micro-batch "
                "the plan fits then never changes the numbers; accepted: train.global_batch=N with it, or a number"
            )
        return self

    @model_validator(mode="after")
    def _cooldown_from_a_checkpoint(self) -> TrainConfig:
        if self.cooldown_steps is not None and self.resume in ("auto", "never"):
            raise ValueError(
                f"train.cooldown_steps={self.cooldown_steps} branches a cooldown from a checkpoint, and train.resume="
                f"{self.resume} names none; accepted: train.resume=RUN/checkpoints/step_N with it (and a new run.dir)"
            )
        return self

    @model_validator(mode="after")
    def _decay_steps_are_wsds(self) -> TrainConfig:
        last = LR_SCHEDULES[self.schedule].decays_over == "last"
        if not last and self.decay_steps is not None:
            wsd = said(tuple(n for n, s in LR_SCHEDULES.items() if s.decays_over == "last"))
            raise ValueError(
                f"train.decay_steps is the length of {wsd}'s decay, and train.schedule={self.schedule} has none; "
                f"accepted: train.schedule={wsd} with it, or no train.decay_steps"
            )
        stable = self.steps - self.warmup_steps
        if last and self.decay_steps is not None and self.decay_steps > stable:
            raise ValueError(
                f"train.decay_steps={self.decay_steps} is longer than the {stable} steps after the warmup "
                f"(train.steps={self.steps} - train.warmup_steps={self.warmup_steps}); accepted: 1..{stable}"
            )
        return self

    @model_validator(mode="after")
    def _stop_inside_the_schedule(self) -> TrainConfig:
        if self.stop_at > self.steps:
            raise ValueError(f"train.stop_at={self.stop_at} is past train.steps={self.steps}; accepted: 0..{self.steps}")
        return self

    @model_validator(mode="after")
    def _scaling_needs_a_base(self) -> TrainConfig:
        if self.lr_scaling != "none" and self.lr_base_batch is None:
            raise ValueError(
                f"train.lr_scaling={self.lr_scaling} needs train.lr_base_batch, the global batch (sequences) train.lr was tuned for"
            )
        return self


Offload = Literal["none", "cpu", "nvme"]


class ParallelConfig(Section):
    # auto: the planner picks the fastest strategy that fits, before anything is allocated.
    strategy: Literal[STRATEGIES + ("auto",)] = STRATEGIES[0]  # type: ignore[valid-type]  # the table's first: plain DDP
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on CUDA, gloo on CPU
    # FSDP2: False keeps parameters gathered between forward and backward (shard-grad-op,
    # ZeRO-2-like); dp_replicate > 1 is hybrid sharding: replicate across groups, shard within.
    reshard_after_forward: bool = True
    dp_replicate: int = Field(1, ge=1)
    # Tensor and pipeline parallel degrees (dp x tp x pp = world size; scaletrain.config.parallel).
    # Tensor parallel splits every block over tp ranks (models/llama_tp.py); pipeline
    # parallel cuts the model into stages of whole blocks (engines/pipeline.py). Both
    # compose with FSDP2 over the data-parallel ranks.
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    # torch.distributed.pipelining's schedule; gpipe and 1f1b run one stage per rank, the
    # others two (interleaved / looped / zero-bubble V). Micro-batches: train.grad_accum.
    pp_schedule: Literal[tuple(SCHEDULES)] = "1f1b"  # type: ignore[valid-type]
    # Expert parallel: a mixture of experts' experts split over ep data-parallel ranks (ep
    # divides the data-parallel shard size and model.moe.experts); engines/expert_parallel.py.
    ep: int = Field(1, ge=1)
    # Context parallel: the sequence split over cp ranks; where it combines: Config. Two
    # designs (docs/parallelism.md compares them): allgather, keys and values all-gathered
    # before each attention (models/context_parallel.py); ulysses, heads and sequence
    # swapped by all-to-all around it (models/ulysses.py).
    cp: int = Field(1, ge=1)
    cp_mode: Literal["allgather", "ulysses"] = "allgather"
    # With tp > 1: the norms and the residual stream hold 1/tp of the sequence each (less
    # activation memory, the same communicated bytes). Off: they are replicated.
    sequence_parallel: bool = True
    # Seconds a collective may wait before the job fails (torch's process-group timeout).
    timeout_s: float = Field(600.0, gt=0)
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    # With it: full recomputes every operation of each block; selective keeps the outputs of the
    # attention kernel and of every other matrix product and recomputes the rest (torchtitan's
    # per-op policy, models/selective_ac.py): more memory than full, about half its recompute.
    ac_mode: Literal["full", "selective"] = "full"
    offload_optimizer: Offload = "none"  # DeepSpeed ZeRO
    offload_params: Offload = "none"  # ZeRO-3 (DeepSpeed); fsdp accepts cpu
    nvme_path: str | None = None  # required by nvme offload
    bucket_size: int = Field(50_000_000, ge=1)  # elements per communication bucket (DeepSpeed)
    # DDP gradient compression through torch's communication hooks: fp16 / bf16 send half
    # the bytes (bf16 needs NCCL); powersgd sends rank-`powersgd_rank` factors with error
    # feedback (Vogels et al. 2019), after `powersgd_start_step` steps of plain all-reduce.
    grad_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd_rank: int = Field(1, ge=1)
    powersgd_start_step: int = Field(1000, ge=2)  # torch's default warm-up
    # Extra DeepSpeed JSON merged into the generated one; a key we set is a conflict error.
    deepspeed_extra: dict[str, Any] = Field(default_factory=dict)
    # Written by scaletrain into the run's resolved config when strategy was auto: the
    # planner's reasons. Informational; ignored as input.
    auto_choice: str | None = None

    @model_validator(mode="after")
    def _ac_mode_with_checkpointing(self) -> ParallelConfig:
        if self.ac_mode == "selective" and not self.activation_checkpointing:
            raise ValueError(
                "parallel.ac_mode=selective chooses what activation checkpointing recomputes, and "
                "parallel.activation_checkpointing is off; accepted: parallel.activation_checkpointing=true with it"
            )
        return self

    @model_validator(mode="after")
    def _compression_is_ddp(self) -> ParallelConfig:
        if self.grad_compression != "none" and not _can(self.strategy, "grad_compression"):
            raise ValueError(
                f"parallel.grad_compression={self.grad_compression} compresses DDP's gradient all-reduce; "
                f"parallel.strategy={self.strategy} has none to compress; accepted: parallel.strategy="
                f"{said(names_where(lambda s: s.grad_compression))}, or grad_compression=none"
            )
        if self.grad_compression == "bf16" and self.backend == "gloo":
            raise ValueError(
                "parallel.grad_compression=bf16 needs NCCL (gloo reduces no bf16); accepted: fp16 or powersgd on gloo"
            )
        return self

    @model_validator(mode="after")
    def _combinations(self) -> ParallelConfig:
        s = self.strategy
        tp, pp = names_where(lambda r: r.tp), names_where(lambda r: r.pp)
        if self.tp > 1 and not _can(s, "tp"):
            raise ValueError(
                f"parallel.tp={self.tp} needs parallel.strategy={said(tp)} (tensor parallel composes with FSDP2 over the "
                f"data-parallel ranks), not {s}; accepted: strategy {said(tp)}, or tp 1"
            )
        if self.pp > 1 and not _can(s, "pp"):
            raise ValueError(
                f"parallel.pp={self.pp} needs parallel.strategy={said(pp)} (each pipeline stage is sharded, or with "
                f"dp_replicate replicated, by FSDP2), not {s}; accepted: strategy {said(pp)}, or pp 1"
            )
        if self.pp > 1 and self.offload_params != "none":
            raise ValueError(
                f"parallel.pp={self.pp} does not combine with parallel.offload_params; accepted: offload_params none"
            )
        if self.offload_optimizer != "none" and not (s in TABLE and TABLE[s].accepts_offload(self.offload_optimizer, "none")):
            takes = said(names_where(lambda r: self.offload_optimizer in r.offload_optimizer))
            raise ValueError(f"parallel.offload_optimizer={self.offload_optimizer} needs strategy {takes}, not {s}")
        if self.offload_params != "none" and not (s in TABLE and TABLE[s].accepts_offload("none", self.offload_params)):
            takes = said(names_where(lambda r: self.offload_params in r.offload_params))
            raise ValueError(f"parallel.offload_params={self.offload_params} needs strategy {takes}, not {s}")
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            raise ValueError("nvme offload needs parallel.nvme_path, a directory on a fast local disk")
        if self.deepspeed_extra and s != "auto" and not TABLE[s].deepspeed_json:
            raise ValueError(f"parallel.deepspeed_extra is only used by {said(names_where(lambda r: r.deepspeed_json))}, not {s}")
        return self


# URL schemes whose paths are local or in memory: no bucket to name.
LOCAL_SCHEMES = ("file", "local", "memory")


class CheckpointConfig(Section):
    every: int = Field(100, ge=0)  # steps between checkpoints; 0: only at the end
    keep: int = Field(3, ge=1)  # newest complete checkpoints kept
    # Save and reload once before the first step (verified tensor by tensor), so that a
    # checkpoint problem (disk, permissions, engine) shows before hours of training.
    verify_on_start: bool = False
    # Torch engines (ddp, fsdp): the loop waits only while the state is copied to CPU
    # memory; DCP writes it from a thread (training/saves.py). DeepSpeed always writes synchronously.
    async_save: bool = True
    # Frozen parameters (model.trainable, LoRA's base): "save" writes them into every
    # checkpoint like the rest; "reference" leaves them out and records where they come
    # from (the base at model.path, or the seeded init), which a resume and an export
    # rebuild and a resume checks is unchanged. A LoRA run's checkpoints shrink to its adapters.
    frozen: Literal["save", "reference"] = "save"
    # Hugging Face weights during training: every this many steps (0: never), and/or after
    # the last step, the checkpoint of that step (written then if not already due) exported
    # to <run.dir>/hf/step_<N> as `ckpt export` writes it (safetensors in bf16, config,
    # tokenizer), by rank 0 once the checkpoint is complete (in the background with async_save).
    hf_every: int = Field(0, ge=0)
    hf_last: bool = False
    # A URL (s3://bucket/prefix): each complete checkpoint copied there by rank 0 (marker
    # last, keep-k there too), and a resume brings the store's newest back first where it is
    # newer than the local ones (checkpoint/remote.py). Unset: <run.dir>/checkpoints only.
    dir: str | None = None

    @field_validator("dir")
    @classmethod
    def _a_url(cls, v: str | None) -> str | None:
        if v is not None and "://" not in v:
            raise ValueError(
                f"checkpoint.dir={v!r} is not a URL; accepted: a URL of object storage (s3://bucket/prefix), or unset "
                "(checkpoints are written under run.dir/checkpoints)"
            )
        scheme, _, rest = (v or "").partition("://")
        if v is not None and scheme not in LOCAL_SCHEMES and not rest.split("/", 1)[0]:
            # fsspec reads s3:// as the store's root: every copy would then fail, after the run trained.
            raise ValueError(f"checkpoint.dir={v!r} names no bucket; accepted: {scheme}://bucket/prefix")
        return v


class TelemetryConfig(Section):
    # Optional sinks beside metrics.jsonl (which is always written), on rank 0.
    tensorboard: bool = False  # event files in <run.dir>/tensorboard (tensorboardX)
    wandb: bool = False  # W&B offline files in <run.dir>/wandb; never touches the network
    wandb_project: str = "scaletrain"
    # [first, last] optimizer steps (inclusive) traced by torch.profiler into
    # <run.dir>/profile as Chrome traces, one per rank; diagnose reads them. Empty: off.
    profile_steps: list[int] = Field(default_factory=list)
    # Every this many steps one step runs under torch.profiler to measure the communication
    # each rank waits for (exposed communication) and, from it, stragglers; 0: off.
    # Its cost is in docs/telemetry.md.
    comm_sample_every: int = Field(200, ge=0)
    # Count each host read of a device tensor (a GPU's host sync) and where it was made, into
    # the interval rows (telemetry/syncs.py, docs/gpu.md). For debugging: it slows the run.
    host_syncs: bool = False
    cost_per_gpu_hour: float = Field(0.0, ge=0)  # per device (a GPU, or a process on CPU); 0: no cost shown
    # A rank whose mean step time over a log interval exceeds the median rank's by this
    # fraction is flagged as a straggler (with its host).
    straggler_threshold: float = Field(0.2, gt=0)
    # Per-device peak FLOP/s (in TFLOP/s) for MFU; unset: the table of known GPUs (bf16/fp16
    # dense, or tf32 for fp32), or on CPU a matmul measured once at start.
    peak_tflops: float | None = Field(None, gt=0)

    @field_validator("profile_steps")
    @classmethod
    def _window(cls, v: list[int]) -> list[int]:
        if v and not (len(v) == 2 and 1 <= v[0] <= v[1]):
            raise ValueError(f"telemetry.profile_steps={v}: accepted: [] (off) or [first, last] with 1 <= first <= last")
        return v


class GuardsConfig(Section):
    # Steps between checks that data-parallel replicas hold identical weights (one small
    # all-gather of a hash); 0: off. Only engines that replicate weights (ddp, zero1, zero2).
    weight_hash_every: int = Field(100, ge=0)
    # A rank that makes no progress for this long has every rank dump its Python stacks and
    # flight-recorder collectives into <run.dir>/hang and the job exits non-zero naming the
    # stuck ranks; well before parallel.timeout_s, the collective timeout. 0: off.
    hang_timeout_s: float = Field(300.0, ge=0)


class RunConfig(Section):
    dir: str = "runs/demo"
    device: Literal["auto", "cpu", "cuda"] = "auto"


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)  # evaluation during training (config/eval.py)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    guards: GuardsConfig = Field(default_factory=GuardsConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)  # replica groups (config/ft.py)

    @model_validator(mode="before")
    @classmethod
    def _implied(cls, data: Any) -> Any:
        return with_implied_precision(data)  # train.float8 without a precision: bf16

    @model_validator(mode="after")
    def _where_checked_beside_their_keys(self) -> Config:
        # Replica groups (config/ft.py), train.float8 (config/float8.py), experts compiled (config/model.py).
        # And context parallel, tiles and activation offload (config/sequences.py).
        problem = fault_tolerance_problem(self) or float8_problem(self) or compiled_experts_problem(self)
        problem = problem or long_sequence_problem(self) or spikes_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _pipeline_schedule(self) -> Config:
        par = self.parallel
        if self.train.loss_chunk_tokens and par.tp > 1:
            raise ValueError(
                f"train.loss_chunk_tokens={self.train.loss_chunk_tokens} does not combine with parallel.tp={par.tp}: under "
                "tensor parallel the loss is already split over the vocabulary (loss parallel); accepted: 0"
            )
        if par.pp == 1:
            return self
        if self.precision == "fp16":
            # Each stage's loss scaler would see only its own gradients' overflows, so the
            # stages could skip different steps; bf16 needs no scaler.
            raise ValueError(f"parallel.pp={par.pp} does not support precision fp16 (loss scaling); accepted: bf16 or fp32")
        # With a global batch, grad_accum is known once the data-parallel size is (config/batch.py checks it then).
        problem = schedule_problem(par.pp_schedule, par.pp, self.train.grad_accum) if self.train.global_batch is None else None
        if problem:
            raise ValueError(f"parallel.pp_schedule={par.pp_schedule}: {problem}")
        if self.train.compile and (problem := compile_problem(par.pp_schedule, par.pp)):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _optimizer_where_built(self) -> Config:
        """train.optimizer on the engines and layouts its entry (optim/registry.py) names."""
        par, entry = self.parallel, OPTIMIZERS[self.train.optimizer]
        where = said(entry.strategies)
        layout = {
            "cp": par.cp, "pp": par.pp, "tp": par.tp, "ep": par.ep, "dp_replicate": par.dp_replicate,
            "offload_params": par.offload_params, "groups": self.fault_tolerance.groups,
        }  # fmt: skip
        unchecked = layout_problem(entry, layout)
        if par.strategy != "auto" and par.strategy not in entry.strategies:
            given, accepted, why = f"parallel.strategy={par.strategy}", f"parallel.strategy={where}", entry.why_not_others
        elif unchecked is not None:
            (given, accepted), why = unchecked, "not checked yet"
        else:
            return self
        default = next(iter(OPTIMIZERS))
        raise ValueError(
            f"train.optimizer={entry.name} runs on {where}, not with {given} ({why}); accepted: {accepted}, or "
            f"train.optimizer={default}"
        )

    @model_validator(mode="after")
    def _experts_where_checked(self) -> Config:
        par, m = self.parallel, self.model
        experts = (m.moe is not None or m.preset in MOE_PRESETS) and MODEL_SOURCES[m.source].experts == "section"
        if par.ep > 1:
            _expert_parallel_problem(self, experts)
        return self

    @model_validator(mode="after")
    def _compile_where_checked(self) -> Config:
        if self.train.compile and (strategy := self.parallel.strategy) != "auto" and not _can(strategy, "compile"):
            compiled = names_where(lambda r: r.compile)
            raise ValueError(
                f"train.compile=true is offered with {' and '.join(compiled)}, with or without tp or pp (checked there), not "
                f"with parallel.strategy={strategy}; accepted: train.compile=false, or parallel.strategy={'|'.join(compiled)}"
            )
        return self

    @model_validator(mode="after")
    def _tokenizer_from_model_dir(self) -> Config:
        # A Hugging Face model directory normally carries the tokenizer the model was trained
        # with: the data is tokenized with it unless data.tokenizer names another. A student
        # shares its teacher's vocabulary, so the teacher's directory serves too.
        for m in (self.model, self.model.teacher):
            if m is not None and m.source == "hf" and m.path and self.data.tokenizer is None:
                tok = Path(m.path).expanduser() / "tokenizer.json"
                if tok.is_file():
                    self.data.tokenizer = str(tok)
        return self

    @model_validator(mode="after")
    def _teacher_where_checked(self) -> Config:
        par = self.parallel
        if self.model.teacher is not None and par.strategy != "auto" and not _can(par.strategy, "teacher"):
            raise ValueError(
                f"model.teacher is not offered with parallel.strategy={par.strategy}; accepted: "
                f"{said(names_where(lambda r: r.teacher))}"
            )
        if self.model.teacher is not None and (par.tp > 1 or par.pp > 1):
            raise ValueError(
                f"model.teacher runs beside data-parallel engines only, not with parallel.tp={par.tp}, pp={par.pp}; "
                "accepted: parallel.tp=1 and parallel.pp=1 (ddp, fsdp, zero1-3)"
            )
        return self

    @model_validator(mode="after")
    def _watchdog_before_timeout(self) -> Config:
        if self.guards.hang_timeout_s >= self.parallel.timeout_s:
            raise ValueError(
                f"guards.hang_timeout_s={self.guards.hang_timeout_s:g} is not below parallel.timeout_s={self.parallel.timeout_s:g}: "
                "the watchdog would fire after the collective already timed out; accepted: a smaller guards.hang_timeout_s (0: off)"
            )
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _expert_parallel_problem(cfg: Config, experts: bool) -> None:
    """parallel.ep > 1: a built-in mixture of experts, on a strategy that has it, in the
    layouts checked so far (the divisibility by the world and the experts is checked where
    those are known: config/parallel.py, the model's spec)."""
    par, m = cfg.parallel, cfg.model
    where = names_where(lambda r: r.ep)
    # A Hugging Face model's experts are its config's: its spec says at build whether it has
    # any and whether they split (models/hf.py check_ep, models/hf_experts.py).
    if not experts and MODEL_SOURCES[m.source].experts != "spec":
        model = f"model.source={m.source} (not built yet)" if m.source != "builtin" else f"model.preset={m.preset} (dense)"
        raise ValueError(
            f"parallel.ep={par.ep} splits a mixture of experts' experts over ranks; {model} has none to split; accepted: "
            f"parallel.ep=1, or a built-in mixture of experts (model.preset={'|'.join(MOE_PRESETS)}, or model.moe)"
        )
    if not _can(par.strategy, "ep"):
        why = TABLE[par.strategy].no_ep_why if par.strategy in TABLE else "auto chooses ep itself: leave parallel.ep at 1"
        raise ValueError(
            f"parallel.ep={par.ep} needs parallel.strategy={said(where)} (the expert weights sharded by FSDP2 over the "
            f"data-parallel ranks beside the ep group), not {par.strategy} ({why}); accepted: "
            f"parallel.strategy={said(where)}, or parallel.ep=1"
        )
    if cfg.train.compile:
        # The all-to-all's split sizes are read on the host (models/moe.py exchange_slots): a
        # graph break in every MoE layer, which fullgraph compilation refuses.
        raise ValueError(
            f"parallel.ep={par.ep} with train.compile=true is not built yet (expert parallel runs eager: its "
            "all-to-all reads the split sizes on the host); accepted: train.compile=false, or parallel.ep=1"
        )


def _can(strategy: str, capability: str) -> bool:
    """Whether `strategy` has a capability of the strategy table. `auto` has none: the
    planner resolves it after these checks, so a setting only some strategies take needs the
    strategy named (not compile and float8: auto's candidates are the layouts they run with)."""
    return strategy in TABLE and bool(getattr(TABLE[strategy], capability))
