"""Fully sharded data parallel with FSDP2 (`fully_shard`): full shard, shard-grad-op, hybrid.

Each transformer block is one FSDP unit (its parameters are all-gathered just before it
runs and freed after), the root owns what is left: embeddings, final norm, output head.
Parameters live as DTensor shards from the start: the model is sharded on the meta device
and only then materialized, so no rank ever allocates the full model.
"""

from __future__ import annotations

import atexit
import contextlib
from collections import defaultdict
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from scaletrain.config import Config
from scaletrain.distributed import World
from scaletrain.engines.base import Materialize
from scaletrain.engines.checkpointing import checkpoint_blocks
from scaletrain.engines.dcp_state import TorchEngineMixin
from scaletrain.engines.precision import AUTOCAST_DTYPES, make_loss_scaler
from scaletrain.errors import UserError
from scaletrain.optim import build_adamw


class FSDPEngine(TorchEngineMixin):
    name = "fsdp"

    def __init__(self, model: nn.Module, world: World, cfg: Config, materialize: Materialize):
        par = cfg.parallel
        mesh = _mesh(world, par.dp_replicate)
        offload = par.offload_params == "cpu"
        if par.activation_checkpointing:
            # Before fully_shard, so the recomputed forward re-gathers the block's parameters
            # through FSDP's hooks; state-dict names stay plain (tests check).
            checkpoint_blocks(model)

        # Parameters that share one tensor (the tied embedding / output head) must stay one
        # parameter through sharding and materialization, or the head silently unties.
        tied = _shared_parameter_names(model)

        kwargs: dict[str, Any] = dict(mesh=mesh, mp_policy=_mp_policy(cfg.precision))
        # pin_memory needs an accelerator; on a CPU-only run the copies are host to host anyway.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=world.device.type == "cuda") if offload else OffloadPolicy()
        n = len(model.layers)
        for i, block in enumerate(model.layers):
            # Backward starts with the last block: resharding it after forward would only
            # free its parameters for the length of the loss and all-gather them again.
            fully_shard(block, reshard_after_forward=par.reshard_after_forward and i < n - 1, **kwargs)
        # The root owns what the blocks do not: embedding, final norm, head. A tied weight is
        # thus one parameter of one FSDP unit, gathered and reduced once. The root is never
        # resharded after forward for the same reason as the last block (its head runs last).
        fully_shard(model, reshard_after_forward=False, **kwargs)

        # DTensor parameters are swapped in place by to_empty (wrapper subclasses always use
        # swap_tensors), so the tied Parameter object survives; checked, not assumed.
        # Offloaded shards (and the optimizer step on them) live in host memory; FSDP copies
        # them to the compute device for each all-gather.
        materialize(model, torch.device("cpu") if offload else world.device)
        _check_still_shared(model, tied)

        self.model: nn.Module = model
        self.fsdp: FSDPModule = model  # type: ignore[assignment]
        self.clip_grad = cfg.train.clip_grad
        # AdamW sees the sharded DTensor parameters: optimizer state is sharded the same way.
        fused = world.device.type == "cuda" and not offload
        self.optimizer = build_adamw(model, cfg.train, fused=fused)
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
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        if self.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip_grad, total, foreach=True)
        return total



def _mesh(world: World, dp_replicate: int) -> DeviceMesh:
    """1-D shard mesh, or 2-D (replicate x shard) for hybrid sharding."""
    size = world.world_size
    if size % dp_replicate:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise UserError(
            f"parallel.dp_replicate={dp_replicate} must divide the world size {size} (hybrid sharding: "
            f"dp_replicate x shard group size = world size); accepted: {', '.join(map(str, divisors))}"
        )
    if not world.distributed:
        _single_rank_group(world.device)
    if dp_replicate == 1:
        return init_device_mesh(world.device.type, (size,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(world.device.type, (dp_replicate, size // dp_replicate), mesh_dim_names=("dp_replicate", "dp_shard"))


def _single_rank_group(device: torch.device) -> None:
    # fully_shard needs a process group even for one process (e.g. to offload parameters on
    # one GPU): a private in-memory store, no ports. Destroyed at exit like the launcher's.
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())


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
