"""ZeRO stages 1/2/3 (with CPU/NVMe offload) through DeepSpeed's own engine.

DeepSpeed owns what it is good at: partitioning, its optimizers (FusedAdam, or
DeepSpeedCPUAdam when the optimizer is offloaded), mixed precision with its dynamic loss
scaler, gradient clipping and the checkpoint format. Everything it needs to know comes
from one JSON generated from our config (deepspeed_config.py), saved beside every
checkpoint. What stays ours: the lr schedule (set on the param groups every step) and when
an accumulation window ends (the trainer says so per micro-batch).
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import warnings
from contextlib import nullcontext, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.config import Config
from scaletrain.distributed import World
from scaletrain.engines.base import Materialize, StepStats
from scaletrain.engines.checkpointing import checkpoint_blocks, plain_name
from scaletrain.engines.deepspeed_config import build_deepspeed_config, to_json
from scaletrain.errors import UserError
from scaletrain.optim import build_adamw

CONFIG_FILE = "deepspeed_config.json"
# DeepSpeed writes each checkpoint into <dir>/<tag>/; one fixed tag because our step
# directories already name the step, and no "latest" file: our COMPLETE marker decides.
TAG = "zero"


class DeepSpeedEngine:
    def __init__(self, model: nn.Module, world: World, cfg: Config, materialize: Materialize):
        self.name = cfg.parallel.strategy
        self.world_size = world.world_size
        self.precision = cfg.precision
        # First, before anything slow: a conflicting deepspeed_extra key stops here.
        self.ds_config = build_deepspeed_config(cfg, world.world_size)
        self._config_json = to_json(self.ds_config)

        deepspeed = _import_deepspeed(world.device)
        _ensure_process_group(world)
        # It adopts the existing group. It also print()s a line on every start (its shared-
        # memory comm op was loaded); stdout is our progress display, so that line goes.
        with open(os.devnull, "w") as sink, redirect_stdout(sink):
            deepspeed.init_distributed(dist_backend=dist.get_backend())
        if cfg.precision == "fp16" and world.device.type == "cpu":
            _allow_fp16_on_cpu()

        if cfg.parallel.activation_checkpointing:
            checkpoint_blocks(model)  # torch's per-block checkpointing; ZeRO-3 re-gathers on recompute
        materialize(model, world.device)  # the full model on every rank; ZeRO partitions it below
        self.module = model
        # The weight-decay grouping (none on 1-D norm gains) comes from the one place that
        # defines it; DeepSpeed's optimizer takes the groups, lr/betas/eps from the JSON.
        groups = [
            {"params": g["params"], "weight_decay": g["weight_decay"]}
            for g in build_adamw(model, cfg.train).param_groups
        ]
        # A copy: DeepSpeed may normalise the dict it is given; the saved JSON stays what we built.
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=groups, config=copy.deepcopy(self.ds_config)
        )
        self.model: nn.Module = self.ds  # forward through the engine: its hooks gather ZeRO-3 params

    def accumulate(self, boundary: bool) -> Any:
        # We own the accumulation window, not DeepSpeed's micro-step counter: the flag makes
        # ZeRO-1 reduce only on the boundary micro-batch (and ZeRO-2/3, which reduce-scatter
        # every micro-batch by design, finish their accumulation there).
        self.ds.set_gradient_accumulation_boundary(boundary)
        return nullcontext()

    def autocast(self) -> Any:
        # DeepSpeed owns precision: with fp16/bf16 it casts the module's parameters itself
        # and keeps fp32 master weights in its optimizer; autocast on top would double up.
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # The trainer already divided by the number of micro-batches; DeepSpeed's default
        # divides by gradient_accumulation_steps again. It still applies its loss scale.
        self.ds.backward(loss, scale_wrt_gas=False)

    def step(self, lr: float) -> StepStats:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.ds.step()  # unscale, overflow check, clip, optimizer step, zero grads
        skipped = not self.ds.was_step_applied()
        # DeepSpeed's global norm (before clipping, after unscaling), summed over all ranks'
        # partitions; inf on an fp16 overflow step.
        norm = self.ds.get_global_grad_norm()
        grad_norm = torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32).detach()
        loss_scale = float(self.optimizer.loss_scale) if self.precision == "fp16" else None
        return StepStats(grad_norm.reshape(()), loss_scale, skipped)

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        # Collective: each rank writes its own partition of optimizer state (and, for
        # ZeRO-3, of the parameters); the fp32 master weights live in those files.
        self.ds.save_checkpoint(str(path), tag=TAG, save_latest=False)

    def load(self, path: Path) -> None:
        saved = _saved_world_size(path)
        if saved == 0:  # DeepSpeed itself would fail on an assert
            raise UserError(
                f"checkpoint {path.parent} holds no DeepSpeed ZeRO state (state/{TAG}/), so another engine wrote it; "
                "accepted: resuming it with the parallel.strategy that wrote it, or a new run.dir"
            )
        if saved != self.world_size:
            raise UserError(
                f"checkpoint {path.parent} was written by DeepSpeed ZeRO on {saved} ranks and resumes only on "
                f"{saved}, not {self.world_size}; accepted: the same number of ranks, or a new run.dir"
            )
        # load_from_fp32_weights (DeepSpeed's default) restores the exact fp32 master
        # partitions, so the resumed run continues bit-exactly.
        loaded, _ = self.ds.load_checkpoint(
            str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if loaded is None:
            raise UserError(f"checkpoint {path.parent}: DeepSpeed could not load state/{TAG}/ (see its warning above)")
        _replay_cpu_adam_steps(self.ds.basic_optimizer)

    def extra_state(self) -> dict[str, Any]:
        # The loss scaler is saved inside DeepSpeed's own checkpoint; this copy is for people
        # reading trainer.json.
        if self.precision != "fp16":
            return {}
        return {"loss_scale": float(self.optimizer.loss_scale), "skipped_steps": int(self.ds.skipped_steps)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass  # DeepSpeed's load_checkpoint already restored the scaler (see extra_state)

    def full_weights(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        # The fp32 master weights (not the fp16/bf16 copies the forward uses), assembled
        # from every rank's partition: a collective. Tied weights appear under each name,
        # like a state_dict.
        out: dict[str, torch.Tensor] = {}
        done: dict[int, torch.Tensor] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            if id(param) not in done:
                full = safe_get_full_fp32_param(param)
                done[id(param)] = (param.detach().float() if full is None else full).detach().cpu().clone()
            out[plain_name(name)] = done[id(param)]
        return out

    def checkpoint_files(self) -> dict[str, str]:
        return {CONFIG_FILE: self._config_json}


def read_deepspeed_weights(state_dir: Path) -> dict[str, torch.Tensor]:
    """Full fp32 model weights by parameter name from what `save` wrote into `state_dir`.

    One process, no process group, CPU only: DeepSpeed's zero_to_fp32 reassembles the
    fp32 master partitions of every rank from the optimizer-state files.
    """
    _import_deepspeed(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # It reports progress with print() and tqdm: a library call should not.
    with open(os.devnull, "w") as sink, redirect_stdout(sink), redirect_stderr(sink):
        state = get_fp32_state_dict_from_zero_checkpoint(str(state_dir), tag=TAG)
    return {plain_name(name): t.float().contiguous() for name, t in state.items()}


def _import_deepspeed(device: torch.device) -> Any:
    # DeepSpeed picks its accelerator once, at import: on a CPU run it must be told, or it
    # looks for CUDA. setdefault: an explicit DS_ACCELERATOR from the user wins.
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # Its INFO lines (config dumps, timers) would interleave with our progress output.
    deepspeed.utils.logger.setLevel(logging.WARNING)
    # DeepSpeed still calls collectives that this torch deprecates, once per bucket: a
    # warning per call the user can do nothing about.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )
    return deepspeed


def _allow_fp16_on_cpu() -> None:
    # DeepSpeed's CPU accelerator reports fp16 as unsupported unless oneDNN has native fp16
    # kernels (AVX512-FP16/AMX-FP16), and refuses to start. torch computes fp16 correctly on
    # any CPU (slower, through fp32 inside its kernels), and DeepSpeed's loss scaler and
    # fp32 master weights do not depend on the device, so fp16 runs and is tested on CPU.
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        accelerator.is_fp16_supported = lambda: True


def _ensure_process_group(world: World) -> None:
    """DeepSpeed needs a process group even for one rank: give a single process its own.

    Multi-rank runs already have one from scaletrain.distributed.init_distributed, which
    deepspeed.init_distributed adopts. For a world of one, an in-memory store makes a
    group of one without a port or launcher environment (DeepSpeed still reads LOCAL_RANK).
    """
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if dist.is_initialized():
        return
    backend = "nccl" if world.device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    # The trainer's shutdown only tears down groups it created (world.distributed); this one is ours.
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())


def _replay_cpu_adam_steps(optimizer: Any) -> None:
    """Bring DeepSpeed's C++ CPU Adam to the state an uninterrupted run would have.

    DeepSpeedCPUAdam, and FusedAdam on the CPU accelerator, keep beta1**t and beta2**t
    inside the C++ optimizer and advance them by one multiplication per step; a fresh
    process resuming at step t gets std::pow(beta, t) instead, which differs in the last
    bits, and so would every update after a resume. Stepping the kernel 1..t over empty
    tensors repeats the uninterrupted run's multiplications exactly (nothing else changes).
    CUDA's FusedAdam derives the bias correction from the step on every call: nothing to do.
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    if not steps:
        return
    beta1, beta2 = optimizer.param_groups[0]["betas"]
    empty = torch.empty(0, dtype=torch.float32)
    if isinstance(optimizer, DeepSpeedCPUAdam):
        for t in range(1, max(steps) + 1):
            optimizer.ds_opt_adam.adam_update(optimizer.opt_id, t, 0.0, beta1, beta2, 1e-8, 0.0, True, empty, empty, empty, empty)
    elif isinstance(optimizer, FusedAdam) and get_accelerator().device_name() == "cpu":
        noop = torch.zeros(1, dtype=torch.int)
        for t in range(1, max(steps) + 1):
            optimizer.multi_tensor_adam(1, noop, [[empty]] * 4, 0.0, beta1, beta2, 1e-8, t, int(optimizer.adam_w_mode), 1, 0.0)


def _saved_world_size(path: Path) -> int:
    # One optimizer-state file per data-parallel rank; ZeRO partitions are tied to that count.
    return len(list((path / TAG).glob("*zero_pp_rank_*_optim_states.pt")))
