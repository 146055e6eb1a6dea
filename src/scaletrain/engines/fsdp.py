"""Fully sharded data parallel with FSDP2 (`fully_shard`): full shard, shard-grad-op, hybrid.

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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from scaletrain.config import Config
from scaletrain.distributed import World, ensure_process_group
from scaletrain.engines.base import ParamGroups
from scaletrain.engines.checkpointing import apply_activation_checkpointing
from scaletrain.engines.dcp_state import TorchEngineMixin
from scaletrain.engines.precision import AUTOCAST_DTYPES, make_loss_scaler
from scaletrain.models.spec import ModelSpec
from scaletrain.optim import build_adamw
from scaletrain.parallel import ParallelDims


class FSDPEngine(TorchEngineMixin):
    name = "fsdp"

    def __init__(self, spec: ModelSpec, world: World, dims: ParallelDims, cfg: Config, param_groups: ParamGroups):
        par = cfg.parallel
        ensure_process_group(world)  # fully_shard needs one even for a single rank
        mesh = dims.fsdp_mesh(world.device)
        offload = par.offload_params == "cpu"
        model = spec.build_meta(cfg.data.seq_len)
        blocks = spec.blocks(model)
        if par.activation_checkpointing:
            # Before fully_shard, so the recomputed forward re-gathers the block's parameters
            # through FSDP's hooks; state-dict names stay plain (tests check).
            apply_activation_checkpointing(blocks)

        # Parameters that share one tensor (the tied embedding / output head) must stay one
        # parameter through sharding and materialization, or the head silently unties.
        tied = _shared_parameter_names(model)
        apply_fsdp(
            model,
            blocks,
            mesh,
            cfg.precision,
            par.reshard_after_forward,
            CPUOffloadPolicy(pin_memory=world.device.type == "cuda") if offload else OffloadPolicy(),
        )

        # DTensor parameters are swapped in place by to_empty (wrapper subclasses always use
        # swap_tensors), so the tied Parameter object survives; checked, not assumed.
        # Offloaded shards (and the optimizer step on them) live in host memory; FSDP copies
        # them to the compute device for each all-gather.
        spec.materialize(model, torch.device("cpu") if offload else world.device, cfg.train.seed)
        _check_still_shared(model, tied)

        self.model: nn.Module = model
        self.fsdp: FSDPModule = model  # type: ignore[assignment]
        self.device = world.device
        self.clip_grad = cfg.train.clip_grad
        # AdamW sees the sharded DTensor parameters: optimizer state is sharded the same way.
        fused = world.device.type == "cuda" and not offload
        self.optimizer = build_adamw(param_groups(model), cfg.train, fused=fused)
        # torch.amp.GradScaler is enough for DTensor gradients: DTensor's handler for
        # _amp_foreach_non_finite_check_and_unscale_ all-reduces found_inf (max) over the
        # mesh, so every rank takes the same skip decision. ShardedGradScaler is for FSDP1.
        self.scaler = make_loss_scaler(cfg.precision, world.device, cfg.train)

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
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        if self.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip_grad, total, foreach=True)
        return total


def apply_fsdp(
    model: nn.Module, blocks: nn.ModuleList, mesh: DeviceMesh, precision: str, reshard_after_forward: bool, offload: OffloadPolicy
) -> None:
    """Each block one FSDP unit (gathered just before it runs, freed after), the root the rest."""
    kwargs: dict[str, Any] = dict(mesh=mesh, mp_policy=_mp_policy(precision), offload_policy=offload)
    n = len(blocks)
    for i, block in enumerate(blocks):
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
