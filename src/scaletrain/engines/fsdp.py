"""Fully sharded data parallel with FSDP2 (`fully_shard`): full shard, shard-grad-op, hybrid,
and composed with DTensor tensor parallelism (parallel.tp: 2-D parameters, dp x tp).

Each transformer block is one FSDP unit (its parameters are all-gathered just before it
runs and freed after), the root owns what is left: embeddings, final norm, output head.
Parameters live as DTensor shards from the start: the model is sharded on the meta device
and only then materialized, so no rank ever allocates the full model.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from scaletrain.config import Config
from scaletrain.config.parallel import ParallelDims
from scaletrain.config.stages import SCHEDULES, check_stages, split_blocks, stage_ids
from scaletrain.engines.base import Mark, MicroBatch, ParamGroups, no_mark
from scaletrain.engines.block_wrappers import apply_activation_checkpointing, compile_blocks
from scaletrain.engines.context import long_sequences
from scaletrain.engines.expert_parallel import shard_experts
from scaletrain.engines.float8 import Float8, apply_float8
from scaletrain.engines.pipeline import MergedStages, Pipeline
from scaletrain.engines.precision import AUTOCAST_DTYPES, make_loss_scaler
from scaletrain.engines.teacher import frozen_meta, teacher_seed
from scaletrain.engines.torch_engine import TorchEngineMixin
from scaletrain.errors import UserError
from scaletrain.launch.distributed import World, ensure_process_group
from scaletrain.models.capabilities import ExpertSplit, PipelineStages, TensorParallel, capability
from scaletrain.models.spec import LossFn, ModelSpec
from scaletrain.optim.optimizers import build_optimizer


class FSDPEngine(TorchEngineMixin):
    name = "fsdp"

    def __init__(
        self,
        spec: ModelSpec,
        world: World,
        dims: ParallelDims,
        cfg: Config,
        param_groups: ParamGroups,
        teacher: ModelSpec | None = None,
    ):
        par = cfg.parallel
        ensure_process_group(world)  # fully_shard needs one even for a single rank
        offload = par.offload_params == "cpu"
        # The logits stay split over the vocabulary for the loss under tensor parallelism.
        self.loss_parallel = dims.tp > 1
        if dims.tp > 1:
            capability(spec, TensorParallel, f"parallel.tp={dims.tp}", "parallel.tp=1").check_tp(dims.tp)

        def build(model: nn.Module) -> nn.Module:
            return _shard_and_materialize(model, spec, world, dims, cfg, offload)

        self.pipeline: Pipeline | None = None
        self.float8: Float8 | None = None
        if dims.pp == 1:
            model = spec.build_meta(cfg.data.seq_len)
            # Float8 first (torchtitan's order), on the meta model: then checkpointing, compile
            # and fully_shard, whose all-gathers carry the converted weights in float8.
            if cfg.train.float8:  # config/float8.py: never with tp
                # Their weights all-gathered in float8 over NCCL; gloo has no float8 dtypes (an
                # all-gather of one fails, "Invalid scalar type"): on a CPU each unit gathers
                # its weights in bf16 and each Float8Linear casts them, as under ddp.
                self.float8 = apply_float8(model, spec, world.device, fsdp=world.device.type == "cuda")
            model = build(model)
        else:
            capability(spec, PipelineStages, f"parallel.pp={dims.pp}", "parallel.pp=1").check_pp(dims.pp)
            ids, parts, ranges = stage_parts(spec, dims, world.rank, par.pp_schedule, cfg.data.seq_len)
            # Float8 on each stage's meta module first, as above: its blocks' Linear layers.
            stages8 = (
                [apply_float8(p, spec, world.device, world.device.type == "cuda") for p in parts] if cfg.train.float8 else []
            )
            parts = [build(part) for part in parts]
            if stages8:
                self.float8 = Float8(nn.ModuleList(parts), stages8[0].ao, precompute=any(f.precompute for f in stages8))
            self.pipeline = Pipeline(
                parts,
                ids,
                ranges,
                par.pp_schedule,
                cfg.train.grad_accum,
                dims.mesh(world.device.type)["pp"].get_group(),
                world.device,
            )
            model = parts[0] if len(parts) == 1 else MergedStages(parts)

        self.model: nn.Module = model
        # The root FSDP module (without a pipeline; the schedule drives each stage's own).
        self.fsdp: FSDPModule = model  # type: ignore[assignment]
        self.device = world.device
        self.clip_grad = cfg.train.clip_grad
        self.save_frozen = cfg.checkpoint.frozen == "save"  # else checkpoints leave them out (checkpoint/frozen_base.py)
        # AdamW (and Muon: optim/muon.py ShardedMuon) sees the sharded DTensor parameters:
        # optimizer state is sharded the same way (in host memory where the parameters are
        # offloaded: the fused CPU kernel then steps them).
        self.optimizer = build_optimizer(param_groups(model), cfg.train, torch.device("cpu") if offload else world.device)
        # Under tensor parallelism without sequence parallel the norms are 1-D (dp) DTensors
        # beside the 2-D (dp, tp) rest, and one foreach norm cannot mix meshes: the gradient
        # norm is taken per mesh. Grouped once here, not every step.
        by_mesh: dict[Any, list[nn.Parameter]] = defaultdict(list)
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                by_mesh[param.device_mesh if isinstance(param, DTensor) else None].append(param)
        self._by_mesh = list(by_mesh.values())
        # torch.amp.GradScaler is enough for DTensor gradients: DTensor's handler for
        # _amp_foreach_non_finite_check_and_unscale_ all-reduces found_inf (max) over the
        # mesh, so every rank takes the same skip decision. ShardedGradScaler is for FSDP1.
        self.scaler = make_loss_scaler(cfg.precision, world.device, cfg.train)
        if teacher is not None:
            self.teacher = sharded_teacher(teacher, world, dims, cfg)
        self.context, self.offload = long_sequences(world, dims, cfg, (spec, model), (teacher, self.teacher))

    def forward_backward(self, micro_batches: list[MicroBatch], loss: LossFn, mark: Mark = no_mark) -> torch.Tensor:
        if self.pipeline is not None:
            inputs = torch.cat([x for x, _ in micro_batches])
            targets = torch.cat([y for _, y in micro_batches])
            with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
                value = self.pipeline.run(inputs, targets, (lambda out, y: _local(loss(out, y))) if self.loss_parallel else loss)
            # Forward and backward of the micro-batches interleave inside the schedule: its
            # whole time is reported as the forward phase.
            mark("forward")
            return value
        if not self.loss_parallel:
            return super().forward_backward(micro_batches, loss, mark)
        # Cross entropy over vocabulary-split logits: forward and backward both inside.
        with loss_parallel():
            return super().forward_backward(micro_batches, lambda out, y: _local(loss(out, y)), mark)

    def evaluate(self, micro_batches: list[MicroBatch], loss: LossFn) -> tuple[torch.Tensor, torch.Tensor]:
        # As forward_backward: vocabulary-split logits under loss_parallel, the schedule's
        # own (forward-only) path under a pipeline.
        local = (lambda out, y: _local(loss(out, y))) if self.loss_parallel else loss
        with loss_parallel() if self.loss_parallel else contextlib.nullcontext():
            if self.pipeline is None:
                return super().evaluate(micro_batches, local)
            inputs = torch.cat([x for x, _ in micro_batches])
            targets = torch.cat([y for _, y in micro_batches])
            return self.pipeline.evaluate(inputs, targets, local)

    def describe(self) -> tuple[dict[str, Any], list[str]]:
        return self.pipeline.describe() if self.pipeline is not None else ({}, [])

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        return self.pipeline.gather(state) if self.pipeline is not None else state

    def full_weights(self) -> dict[str, torch.Tensor]:
        if self.pipeline is None:
            return super().full_weights()
        # Every rank's stages in full (cpu_offload would keep them on global rank 0 only,
        # which holds the first stage), then the union over the pipeline group.
        mine = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        gathered = self.pipeline.gather({"model": {k: v.detach().cpu() for k, v in mine.items() if isinstance(v, torch.Tensor)}})
        return gathered["model"]

    def accumulate(self, boundary: bool) -> Any:
        return self._gradient_sync(boundary)

    @contextlib.contextmanager
    def _gradient_sync(self, boundary: bool) -> Iterator[None]:
        # Off the boundary FSDP keeps unsharded gradients (in the fp32 reduce dtype) and skips
        # reduce-scatter (and HSDP's all-reduce); the boundary backward reduces the sum once.
        self.fsdp.set_requires_gradient_sync(boundary)
        try:
            yield
        finally:
            self.fsdp.set_requires_gradient_sync(True)

    def autocast(self) -> Any:
        # MixedPrecisionPolicy already casts the gathered parameters (and floating inputs) to
        # the low-precision type; loss_fn upcasts the logits to fp32. No autocast on top.
        return contextlib.nullcontext()

    def clip_gradients(self) -> torch.Tensor:
        # The norm of sharded gradients is a partial DTensor; full_tensor() reduces it once
        # (one collective, no host sync) and the plain total then scales each local shard.
        groups = [[p for p in params if p.grad is not None] for params in self._by_mesh]
        groups = [g for g in groups if g]
        norms = []
        for group in groups:
            norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], foreach=True)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if not norms:  # a pipeline stage whose parameters are all frozen (model.trainable)
            total = torch.zeros((), device=self.device)
        else:
            total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
        if self.pipeline is not None:
            total = self.pipeline.total_norm(total)  # this rank holds its stages' parameters only
        if self.clip_grad > 0:
            for group in groups:
                torch.nn.utils.clip_grads_with_norm_(group, self.clip_grad, total, foreach=True)
        return total


def _shard_and_materialize(
    model: nn.Module, spec: ModelSpec, world: World, dims: ParallelDims, cfg: Config, offload: bool
) -> nn.Module:
    """Tensor parallel plan, activation checkpointing, FSDP2 sharding, then allocation of
    this rank's shards only: the whole model, or one pipeline stage of it."""
    par = cfg.parallel
    # Parameters that share one tensor (the tied embedding / output head) must stay one
    # parameter through sharding and materialization, or the head silently unties.
    tied = _shared_parameter_names(model)
    # Tensor parallel first, on the plain model (its plan names submodules the checkpoint
    # wrapper would rename): FSDP then shards each rank's tp slice over the dp ranks.
    if dims.tp > 1:
        tp = capability(spec, TensorParallel, f"parallel.tp={dims.tp}", "parallel.tp=1")
        tp.apply_tp(model, dims.mesh(world.device.type)["tp"], par.sequence_parallel, loss_parallel=True)
    # Expert parallel likewise before FSDP: the experts' ep placement, which FSDP composes with.
    experts: list[nn.Module] = []
    if dims.ep > 1:
        split = capability(spec, ExpertSplit, f"parallel.ep={dims.ep}", "parallel.ep=1")
        split.check_ep(dims.ep)
        expert_dp, ep_mesh = dims.expert_meshes(world.device)
        experts = split.split_experts(model, ep_mesh)
    blocks = spec.blocks(model)
    if par.activation_checkpointing:
        # Before fully_shard, so the recomputed forward re-gathers the block's parameters
        # through FSDP's hooks; state-dict names stay plain (tests check).
        apply_activation_checkpointing(blocks, par.ac_mode == "selective")
    if cfg.train.compile:
        compile_blocks(blocks)
    # A pipeline stage runs forward for several micro-batches before their backward:
    # resharding would all-gather its weights again for each (torchtitan keeps them
    # gathered too). A stage is 1/pp of the model; the planner counts the copy.
    reshard = par.reshard_after_forward and dims.pp == 1
    offload_policy = CPUOffloadPolicy(pin_memory=world.device.type == "cuda") if offload else OffloadPolicy()
    if experts:
        kwargs = dict(mp_policy=_mp_policy(cfg.precision), offload_policy=offload_policy, reshard_after_forward=reshard)
        shard_experts(experts, expert_dp, dims.dp_size * dims.cp, **kwargs)
    apply_fsdp(model, blocks, dims.fsdp_mesh(world.device), cfg.precision, reshard, offload_policy)
    # DTensor parameters are swapped in place by to_empty (wrapper subclasses always use
    # swap_tensors), so the tied Parameter object survives; checked, not assumed.
    # Offloaded shards (and the optimizer step on them) live in host memory; FSDP copies
    # them to the compute device for each all-gather.
    spec.materialize(model, torch.device("cpu") if offload else world.device, cfg.train.seed)
    if offload:
        # FSDP moves only the parameters it manages to the compute device; buffers (the
        # rotary tables, a router's bias) stay where materialize put them, and the first
        # forward on a GPU would meet a host tensor (seen on an H200: cuda:0 and cpu).
        _buffers_to(model, world.device)
    _check_still_shared(model, tied)
    return model


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))  # a registered buffer stays one, persistent or not


def sharded_teacher(spec: ModelSpec, world: World, dims: ParallelDims, cfg: Config) -> nn.Module:
    """The frozen teacher as FSDP units of its own (engines/teacher.py): each block, then
    the rest (embedding, norm, head), all resharded after their forward, which is all they
    run. Its shards stay fp32 like the student's; the forward gathers them in the compute
    dtype (MixedPrecisionPolicy)."""
    model = frozen_meta(spec, cfg.data.seq_len)
    kwargs: dict[str, Any] = dict(mesh=dims.fsdp_mesh(world.device), mp_policy=_mp_policy(cfg.precision))
    for block in spec.blocks(model).children():
        fully_shard(block, reshard_after_forward=True, **kwargs)
    fully_shard(model, reshard_after_forward=True, **kwargs)
    spec.materialize(model, world.device, teacher_seed(cfg.train.seed))
    return model


def _local(value: torch.Tensor) -> torch.Tensor:
    """The loss parallel cross entropy's replicated DTensor as the plain scalar the loop sums."""
    return value.to_local() if isinstance(value, DTensor) else value


def stage_parts(
    spec: ModelSpec, dims: ParallelDims, rank: int, schedule: str, seq_len: int
) -> tuple[list[int], list[nn.Module], list[range]]:
    """The stages `rank` runs (indices, meta-device modules) and every stage's blocks;
    blocks are split so that the costliest stage (the embedding on the first, the head on
    the last counted) is as cheap as it can be."""
    check_stages(spec.n_blocks, dims.pp, schedule)
    n_stages = dims.pp * SCHEDULES[schedule][1]
    ids = stage_ids(schedule, dims.pp, dims.coordinates(rank)["pp"])
    stages = capability(spec, PipelineStages, f"parallel.pp={dims.pp}", "parallel.pp=1")
    first, block, last = stages.stage_costs(seq_len)
    ranges = split_blocks(spec.n_blocks, n_stages, block, first, last)

    def stage(i: int) -> nn.Module:
        part = spec.build_meta(seq_len)
        stages.pipeline_stage(part, ranges[i], first=i == 0, last=i == n_stages - 1)
        return part

    counts = spec.counts()
    if counts.trainable != counts.total:
        # A frozen base: a stage with nothing to train would have an empty optimizer, which
        # torch's state-dict helpers refuse. Every rank checks every stage: the same verdict.
        for i in range(n_stages):
            if not any(p.requires_grad for p in stage(i).parameters()):
                raise UserError(
                    f"pipeline stage {i} (blocks {ranges[i].start}-{ranges[i].stop - 1}) has no trainable parameter under "
                    "model.trainable; accepted: patterns that leave every stage something to train, or a smaller parallel.pp"
                )
    return ids, [stage(i) for i in ids], ranges


def apply_fsdp(
    model: nn.Module, blocks: nn.Module, mesh: DeviceMesh, precision: str, reshard_after_forward: bool, offload: OffloadPolicy
) -> None:
    """Each block one FSDP unit (gathered just before it runs, freed after), the root the rest."""
    kwargs: dict[str, Any] = dict(mesh=mesh, mp_policy=_mp_policy(precision), offload_policy=offload)
    n = len(blocks)  # type: ignore[arg-type]
    for i, block in enumerate(blocks.children()):
        # Backward starts with the last block: resharding it after forward would only
        # free its parameters for the length of the loss and all-gather them again.
        fully_shard(block, reshard_after_forward=reshard_after_forward and i < n - 1, **kwargs)
    # The root owns what the blocks do not: embedding, final norm, head. A tied weight is
    # thus one parameter of one FSDP unit, gathered and reduced once. The root is never
    # resharded after forward for the same reason as the last block (its head runs last).
    fully_shard(model, reshard_after_forward=False, **kwargs)


def _mp_policy(precision: str) -> MixedPrecisionPolicy:
    if precision == "fp32":
        return MixedPrecisionPolicy()
    # Compute in bf16/fp16 on gathered copies; shards, gradients and their reduction stay
    # fp32 so that summing over ranks loses nothing and the optimizer updates fp32 masters.
    return MixedPrecisionPolicy(param_dtype=AUTOCAST_DTYPES[precision], reduce_dtype=torch.float32)


def _shared_parameter_names(model: nn.Module) -> list[list[str]]:
    by_id: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id[id(p)].append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _check_still_shared(model: nn.Module, groups: list[list[str]]) -> None:
    for names in groups:
        params = [model.get_parameter(n) for n in names]
        if any(p is not params[0] for p in params[1:]):
            raise RuntimeError(f"FSDP materialization untied the shared parameters {names}")


ENGINE = FSDPEngine  # what engines.build_engine constructs for this module's strategies
