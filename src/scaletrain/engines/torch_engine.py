"""What the torch-native engines (ddp, fsdp) share: model + optimizer state through
torch.distributed.checkpoint, and the loss-scaled optimizer step.

get_state_dict keys everything by parameter name (wrapper prefixes stripped) and keeps
FSDP2 shards as DTensors, so DCP can reload onto another world size or another torch
engine: the resharding the roadmap builds on.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

import scaletrain.checkpoint.dcp_format  # noqa: F401  # its filter of DCP's single-process warning
from scaletrain.engines.base import AccumulationWindow, Mark, MicroBatch, StepStats, no_mark, set_lr
from scaletrain.launch.distributed import side_group
from scaletrain.models.spec import LossFn
from scaletrain.optim.optimizers import after_load, averaged, skip_where, training_weights

# Engine-neutral state (Engine.state_dict): full tensors on every rank, plain names,
# torch's flattened optimizer layout ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr").
NEUTRAL = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
# The same keys, each rank holding its own shards: what DCP saves. On disk a checkpoint is
# then keyed exactly as the neutral state ("model.<fqn>", "optim.state.<fqn>.exp_avg"), so
# checkpoint/neutral.py reads it without knowing the engine that wrote it.
LOCAL = StateDictOptions(flatten_optimizer_state_dict=True)
# The same without the frozen parameters (checkpoint.frozen=reference: checkpoint/frozen_base.py);
# loading one leaves the frozen parameters as the model was built, from its base.
TRAINED = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


def save_dcp(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    background: bool = False,
    frozen: bool = True,
    staging: Staging | None = None,
) -> Future[Any] | None:
    """Write now; or copy the state to CPU memory (`staging`'s, reused save after save) and
    write that from a thread (the future completes once it is on disk). Without `frozen`,
    the frozen parameters are left out."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=LOCAL)
    if not frozen:
        left_out = frozen_keys(model)
        model_sd = {k: v for k, v in model_sd.items() if k not in left_out}
    state = {"model": model_sd, "optim": optim_sd}
    if not background:
        dcp.save(state, checkpoint_id=str(path))
        return None
    once = staging is None  # no engine to keep it: freed with this save
    staging = staging or Staging()
    # async_save returns once the copy is done (training may change the weights right
    # after). Its collectives (the save plan, the final metadata) run on a gloo group of
    # their own: on training's group they interleave with training's and deadlock. A plain
    # Future: the staging/upload pair comes only with an asynchronous stager.
    group = side_group("checkpoint")
    written = cast(
        Future, dcp.async_save(state, checkpoint_id=str(path), process_group=group, async_stager=staging.stager(model_sd))
    )
    if once:
        written.add_done_callback(lambda _: staging.close())
    return written


class Staging:
    """The CPU memory background saves copy the state into, made at the first save and kept
    for every later one: torch's stager keeps one buffer per source storage (the weights and
    optimizer state are updated in place, so their storages stay the same), pinned from a
    GPU. Pinning is the costly part of a fresh buffer (on an H100 a 1B-parameter FSDP state,
    12 GB, blocked 3.6-5.3 s per save when pinned anew each time, docs/checkpointing.md); a
    save copies into it at the bus's speed (non-blocking, then one synchronize). On a CPU a
    plain copy (the pinned and non-blocking options need an accelerator).

    One save is in flight at a time (training/saves.py waits for the one before), so the next copy
    never overwrites a buffer still being written. Closed with the engine: a closed stager
    cannot stage again (torch clears its copy dispatch table: `KeyError: <class 'type'>`,
    what an earlier version that closed it after each save and then reused it ran into)."""

    def __init__(self) -> None:
        self._stager: DefaultStager | None = None

    def stager(self, model_sd: dict[str, Any]) -> DefaultStager:
        if self._stager is None:
            on_gpu = any(isinstance(t, torch.Tensor) and t.is_cuda for t in model_sd.values())
            options = StagingOptions(
                use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=on_gpu
            )
            self._stager = DefaultStager(options)
        return self._stager

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def frozen_keys(model: nn.Module) -> set[str]:
    """The state-dict keys of the frozen parameters. torch's ignore_frozen_params drops a
    frozen parameter under its first name only; a tied alias (the output head of a frozen
    tied embedding) is the same tensor under another key, found by its storage."""
    every = get_model_state_dict(model, options=LOCAL)
    frozen = every.keys() - get_model_state_dict(model, options=TRAINED).keys()
    places = {_place(every[k]) for k in frozen} - {None}
    return frozen | {k for k, v in every.items() if _place(v) in places}


def _place(t: Any) -> tuple[int, tuple[int, ...]] | None:
    """Where this rank's part of a tensor lives (address and shape): equal for a tied weight's
    two names. None for an empty shard, which shares nothing."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if not isinstance(local, torch.Tensor) or local.numel() == 0:
        return None
    return int(local.data_ptr()), tuple(local.shape)


def load_dcp(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Each rank reads the byte ranges its shards overlap: any world size, ddp or fsdp.
    A checkpoint without the frozen parameters loads the rest over the model as built."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=LOCAL)
    frozen = frozen_keys(model)
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    options = LOCAL
    if frozen and not any(f"model.{k}" in saved for k in frozen):
        options = TRAINED
        model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


class TorchEngineMixin(AccumulationWindow):
    """Backward, the loss-scaled optimizer step and state handling, shared by the
    torch-native engines (ddp, fsdp).

    Not an engine: each engine still owns its wrapping, precision, accumulation and
    `clip_gradients` (plain tensors for DDP, DTensor shards for FSDP2). Needs `model`,
    `device`, `optimizer` and `scaler` (a GradScaler for fp16, else None).
    """

    format = "dcp"
    save_frozen = True  # checkpoint.frozen: whether save() writes the frozen parameters
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    staging: Staging | None = None  # background saves' CPU copy, made at the first one
    float8: Any = None  # train.float8: engines/float8.py's Float8 (its after_step hook)

    def clip_gradients(self) -> torch.Tensor:
        """Clip (if configured) and return the global gradient norm as a 0-d tensor."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, lr: float, across: Callable[[], bool] | None = None, limit: float | None = None) -> StepStats:
        set_lr(self.optimizer, lr)
        if across is not None and not across():  # before clipping: the norm is of the averaged gradients
            self.optimizer.zero_grad(set_to_none=True)
            return StepStats(torch.zeros((), device=self.device), None, torch.zeros((), dtype=torch.bool), committed=False)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = self.clip_gradients()
        if self.scaler:
            assert limit is None  # train.spikes is refused with fp16 (config/spikes.py)
            # What the scaler found while unscaling (all-reduced over a DTensor's mesh), taken
            # before update() forgets it: the step is skipped exactly when it is set.
            skipped = sum(self.scaler._found_inf_per_device(self.optimizer).values()) > 0
            # With a fused optimizer the scaler hands it found_inf and the kernel skips on the
            # device: no host sync (with another optimizer it reads the flag itself).
            self.scaler.step(self.optimizer)
            self.scaler.update()
            loss_scale = self.scaler._get_scale_async()
            assert loss_scale is not None
            return self._stepped(grad_norm, loss_scale.detach().clone().reshape(()), skipped)
        # A NaN or inf gradient would poison both Adam moments for good: never applied.
        skipped = ~torch.isfinite(grad_norm)
        if limit is not None:  # a spike (resilience/spikes.py): compared on the device, no sync
            skipped = skipped | (grad_norm > limit)
        skip_where(self.optimizer, skipped)
        return self._stepped(grad_norm, None, skipped)

    def _stepped(self, grad_norm: torch.Tensor, loss_scale: torch.Tensor | None, skipped: torch.Tensor) -> StepStats:
        self._weights_changed()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(grad_norm.detach(), loss_scale, skipped.detach().reshape(()))

    def forward_backward(self, micro_batches: list[MicroBatch], loss: LossFn, mark: Mark = no_mark) -> torch.Tensor:
        training_weights(self.optimizer)  # a schedule-free optimizer's, after a load or an evaluation
        return super().forward_backward(micro_batches, loss, mark)

    def evaluate(self, micro_batches: list[MicroBatch], loss: LossFn) -> tuple[torch.Tensor, torch.Tensor]:
        with averaged(self.optimizer):  # a schedule-free optimizer's evaluation weights (optim/optimizers.py)
            return super().evaluate(micro_batches, loss)

    def save(self, path: Path, background: bool = False) -> Future[Any] | None:
        if background and self.staging is None:
            self.staging = Staging()
        # A checkpoint holds the weights worth keeping: a schedule-free optimizer's averaged
        # ones (a background save has copied them when save_dcp returns).
        with averaged(self.optimizer):
            return save_dcp(self.model, self.optimizer, path, background, frozen=self.save_frozen, staging=self.staging)

    def load(self, path: Path) -> None:
        load_dcp(self.model, self.optimizer, path)
        self._loaded()

    def _loaded(self) -> None:
        after_load(self.optimizer)
        self._weights_changed()

    def _weights_changed(self) -> None:
        # train.float8 under FSDP2: the weights' float8 scales, from their new values, in one
        # all-reduce (engines/float8.py); they must follow every change, loads included.
        if self.float8 is not None:
            self.float8.after_step()

    def state_dict(self) -> dict[str, Any]:
        with averaged(self.optimizer):  # as save
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=NEUTRAL)
            model_sd, optim_sd = _on_cpu(model_sd), _on_cpu(optim_sd)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Each rank cuts its own shard from the full tensors (every rank has them, so no
        # communication) and loads in the engine's own layout. torch's full_state_dict load
        # path fails on a fresh optimizer (KeyError 'param_groups.0.params.0', torch 2.13).
        model_template, optim_template = get_state_dict(self.model, self.optimizer, options=LOCAL)
        template: dict[str, Any] = dict(model_template)
        model_sd: dict[str, Any] = {k: _like(template[k], v) for k, v in state["model"].items() if k in template}
        # A state without the frozen parameters (checkpoint.frozen=reference; read_state
        # let only those be missing): they stay as the model was built.
        options = LOCAL if model_sd.keys() == template.keys() else TRAINED
        # Group settings a converted DeepSpeed checkpoint does not carry come from this
        # optimizer (the config's); torch also reads them to tell a tied weight's names apart.
        optim_sd: dict[str, Any] = {k: v for k, v in optim_template.items() if k.startswith("param_groups.")}
        for key, value in state["optim"].items():
            fqn = key.split(".", 1)[1].rsplit(".", 1)[0]  # state.<fqn>.<key> | param_groups.<fqn>.<key>
            if fqn not in template:
                continue  # another pipeline stage's parameter
            if key.startswith("state.") and isinstance(value, torch.Tensor) and value.dim() > 0:
                value = _like(template[fqn], value)
            optim_sd[key] = value
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
        self._loaded()

    def extra_state(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler else {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if self.scaler and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])
        elif self.scaler and "loss_scale" in state:  # a DeepSpeed checkpoint, converted: its scale carries over
            self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": float(state["loss_scale"])})

    def full_weights(self) -> dict[str, torch.Tensor]:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return dict(get_model_state_dict(self.model, options=opts))  # type: ignore[arg-type]

    def checkpoint_files(self) -> dict[str, str]:
        return {}


def _like(template: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` in the layout of `template`: this rank's shard of a DTensor, else as it is."""
    if isinstance(template, DTensor):
        return distribute_tensor(
            full.to(template.device, template.dtype), template.device_mesh, template.placements, src_data_rank=None
        )
    return full.to(template.device, template.dtype)


def _on_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
