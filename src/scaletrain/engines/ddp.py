"""Data parallel with torch DDP (and the same code path as a plain single process)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from scaletrain.config import Config
from scaletrain.config.parallel import ParallelDims
from scaletrain.engines import compression
from scaletrain.engines.base import ParamGroups
from scaletrain.engines.block_wrappers import apply_activation_checkpointing, compile_blocks
from scaletrain.engines.context import long_sequences
from scaletrain.engines.float8 import apply_float8
from scaletrain.engines.precision import autocast_context, make_loss_scaler
from scaletrain.engines.teacher import replicated_teacher
from scaletrain.engines.torch_engine import TorchEngineMixin
from scaletrain.launch.distributed import World
from scaletrain.models.spec import ModelSpec
from scaletrain.optim.optimizers import build_optimizer
from scaletrain.resilience import faults


class DDPEngine(TorchEngineMixin):
    name = "ddp"

    def __init__(
        self,
        spec: ModelSpec,
        world: World,
        dims: ParallelDims,
        cfg: Config,
        param_groups: ParamGroups,
        teacher: ModelSpec | None = None,
    ):
        model = spec.build_meta(cfg.data.seq_len)
        # Float8 first (torchtitan's order): checkpointing and compile then wrap Float8Linear.
        self.float8 = apply_float8(model, spec, world.device, fsdp=False) if cfg.train.float8 else None
        if cfg.parallel.activation_checkpointing:
            apply_activation_checkpointing(spec.blocks(model), cfg.parallel.ac_mode == "selective")
        if cfg.train.compile:
            compile_blocks(spec.blocks(model))
        spec.materialize(model, world.device, cfg.train.seed)  # every rank holds the full model
        self.module = model
        self.distributed = world.distributed
        self.rank, self.world_size = world.rank, world.world_size
        self.powersgd: Any = None  # its error feedback is state: saved with each checkpoint
        if world.distributed:
            device_ids = [world.device] if world.device.type == "cuda" else None
            # Gradients as views into DDP's communication buckets: one copy of the gradients
            # instead of two (bucket + .grad), 4 bytes per parameter less in fp32.
            # PowerSGD keys its saved state by bucket index. DDP re-buckets once, after the first
            # backward, by the order gradients arrived; a resumed run's first step would then
            # use the first layout against state saved for the second (sizes differ: seen).
            # DDP never re-buckets when it looks for unused parameters, so the layout is the
            # same in every process; the search walks the autograd graph once per step.
            self.model: nn.Module = DistributedDataParallel(
                model,
                device_ids=device_ids,
                gradient_as_bucket_view=True,
                find_unused_parameters=cfg.parallel.grad_compression == "powersgd",
            )
            delay = faults.slowdown("comm")
            if delay:
                self.model.register_comm_hook(delay, _slow_link_allreduce)
            else:
                self.powersgd = compression.register(self.model, cfg.parallel, world.backend or "")
        else:
            self.model = model
        self.device = world.device
        self.precision = cfg.precision
        self.clip_grad = cfg.train.clip_grad
        self.save_frozen = cfg.checkpoint.frozen == "save"  # else checkpoints leave them out (checkpoint/frozen_base.py)
        self.optimizer = build_optimizer(param_groups(model), cfg.train, world.device)
        self.scaler = make_loss_scaler(cfg.precision, world.device, cfg.train)
        if teacher is not None:
            self.teacher = replicated_teacher(teacher, cfg.data.seq_len, world.device, cfg.train.seed, cfg.precision)
        self.context, self.offload = long_sequences(world, dims, cfg, (spec, model), (teacher, self.teacher))

    def save(self, path: Path, background: bool = False) -> Future[Any] | None:
        if self.powersgd is not None:
            compression.save(self.powersgd, path, self.rank, self.world_size)
        return super().save(path, background)

    def load(self, path: Path) -> None:
        super().load(path)
        if self.powersgd is not None:
            compression.load(self.powersgd, path, self.rank, self.world_size)

    def accumulate(self, boundary: bool) -> Any:
        # no_sync skips DDP's gradient all-reduce on non-boundary micro-batches; gradients
        # accumulate locally and the boundary backward reduces the sum once.
        if boundary or not self.distributed:
            return nullcontext()
        return self.model.no_sync()  # type: ignore[operator]

    def autocast(self) -> Any:
        return autocast_context(self.precision, self.device)

    def clip_gradients(self) -> torch.Tensor:
        max_norm = self.clip_grad if self.clip_grad > 0 else float("inf")
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


# No annotations on bucket and result: DDP compares them with dist.GradBucket and
# Future[Tensor] as objects, and this module's annotations are strings (PEP 563).
def _slow_link_allreduce(delay: float, bucket):
    """Fault injection (SCALETRAIN_SLOW=comm:S): the bucket's all-reduce completes `delay`
    seconds late, as over a slow link; DDP's backward waits for it like for a real one."""

    def late(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        time.sleep(delay)
        return fut.value()

    return allreduce_hook(None, bucket).then(late)  # type: ignore[arg-type]


ENGINE = DDPEngine  # what engines.build_engine constructs for this module's strategies
