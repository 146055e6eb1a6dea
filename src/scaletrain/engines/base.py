"""The one protocol every engine implements; the trainer talks to nothing else.

Each engine module owns its quirks (wrapping, precision policy, when gradients are
synchronised, who clips, how state is saved). No engine inherits from another.

An engine is built from a model spec (the model on the meta device, its blocks, how to
materialize it), the parallel layout, and the parameter groups the caller wants optimized;
it decides the order itself: DDP allocates then wraps; FSDP2 shards then allocates only its
shard; DeepSpeed allocates then hands the module to deepspeed.initialize.

The unit of work is `forward_backward(micro_batches, loss)`: the whole accumulation window
with its boundary, precision context and backward inside, so that a pipeline schedule (which
owns forward and backward of all micro-batches), a teacher's outputs in the loss or a
Hugging Face output object fit without the loop knowing. Then `step(lr)`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from scaletrain.engines.offload import ActivationOffload
from scaletrain.models.context_parallel import ContextParallel
from scaletrain.models.loss import trained
from scaletrain.models.spec import LossFn
from scaletrain.models.ulysses import Ulysses

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets)
Mark = Callable[[str], None]  # called at the end of a phase (telemetry/clock.py)


def no_mark(phase: str) -> None:
    pass


# What the caller optimizes: the model (as the engine holds it, sharded or wrapped) ->
# torch-style parameter groups. Parameters in no group are not optimized (frozen); a
# group's "lr_scale" multiplies the scheduled learning rate for it.
ParamGroups = Callable[[nn.Module], list[dict[str, Any]]]


@dataclass
class StepStats:
    # Each figure stays where the engine has it, a 0-d tensor on the device where it can:
    # telemetry reads them all once per log interval, so a step makes no host sync
    # (DeepSpeed's own step reads its norm and overflow flag: host values there).
    grad_norm: torch.Tensor  # the global gradient norm, before clipping
    loss_scale: torch.Tensor | float | None  # fp16 dynamic loss scale after this step; None without scaling
    skipped: torch.Tensor | bool  # not applied: non-finite gradients (an fp16 overflow, a NaN); nothing changed
    # Replica groups: False when the quorum did not commit the step (a group failed during
    # it); nothing changed and the step runs again on the next batch (resilience/replica_groups.py).
    committed: bool = True


class Engine(Protocol):
    name: str  # the strategy: ddp | fsdp | zero1 | zero2 | zero3
    format: str  # what save() writes: "dcp" (torch.distributed.checkpoint) | "deepspeed"
    model: nn.Module  # what forward runs: the wrapper (DDP, DeepSpeed) or the sharded module

    def forward_backward(self, micro_batches: list[MicroBatch], loss: LossFn, mark: Mark = no_mark) -> torch.Tensor:
        """Forward and backward over one accumulation window; gradients are synchronised
        at its end. Returns this rank's mean loss over the window (on device, no sync).
        `mark(phase)` is called as each phase ends ("forward", "backward"), for telemetry."""

    def evaluate(self, micro_batches: list[MicroBatch], loss: LossFn) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only, no gradient, the model in eval mode (dropout off) and its training
        mode restored after: (this rank's sum of the per-token losses, its token count), fp64
        0-d tensors on the device, no sync. `loss` gives a micro-batch's mean over its tokens.
        The ranks of a tensor-parallel group each return their group's; a pipeline stage
        that holds no loss returns zeros. A teacher does not run."""

    def step(self, lr: float, across: Callable[[], bool] | None = None, limit: float | None = None) -> StepStats:
        """Unscale, clip, optimizer step at `lr` (x each group's lr_scale), zero gradients.
        A step whose global gradient norm is NaN or inf, or above `limit` (train.spikes,
        the engines whose strategy `holds_back`: decided on the device), is not applied:
        weights and optimizer state stay exactly as they were (StepStats.skipped). `across`
        (fault_tolerance.groups, torch engines only): called first, it averages the
        gradients over the live replica groups; False: the step is applied nowhere, the
        gradients are dropped (StepStats.committed False)."""

    def state_dict(self) -> dict[str, Any]:
        """Collective: engine-neutral state, full tensors on CPU on every rank, keyed by plain
        parameter names: {"model": {name: fp32 tensor}, "optim": {"state.<name>.exp_avg" |
        ".exp_avg_sq" | ".step": tensor, "param_groups.<name>.<key>": value}} (torch's
        flattened optimizer layout). Any engine loads any engine's."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Collective: restore what some engine's state_dict gave (weights and optimizer)."""

    def save(self, path: Path, background: bool = False) -> Future[Any] | None:
        """Collective, the fast path: write model + optimizer state natively into directory `path`.
        With `background`, an engine that can returns as soon as the state is copied
        (training may change it) and a future that completes once it is on disk; one
        that cannot writes it now and returns None."""

    def load(self, path: Path) -> None:
        """Collective: restore what `save` wrote (on any world size the engine supports)."""

    def extra_state(self) -> dict[str, Any]:
        """Small JSON-able engine state outside model/optimizer (e.g. the loss scaler)."""

    def load_extra_state(self, state: dict[str, Any]) -> None: ...

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Collective: unsharded model weights on CPU by parameter name (rank 0 at least; the
        entries of an unsharded model may be its live parameters: copy before stepping)."""

    def checkpoint_files(self) -> dict[str, str]:
        """Extra text files to write beside every checkpoint (name -> content), e.g. the DeepSpeed JSON."""

    def describe(self) -> tuple[dict[str, Any], list[str]]:
        """What the engine adds to run.json, and the lines it says at start (a pipeline's stages)."""


class AccumulationWindow:
    """The forward_backward of the engines that are not pipelined (ddp, fsdp, zero1-3).

    Needs `model` (what forward is called on), `device`, and the engine's own
    `accumulate(boundary)` (no gradient sync before the boundary), `autocast()` (forward
    precision) and `backward(loss)`.
    """

    model: nn.Module
    device: torch.device
    # A frozen teacher (engines/teacher.py): run first on each micro-batch, without
    # gradients; the loss then takes (model output, teacher output).
    teacher: Callable[[torch.Tensor], Any] | None = None
    # parallel.cp: the model takes the whole sample and computes this rank's chunks of it
    # (models/context_parallel.py, models/ulysses.py); the targets are cut to the same chunks here.
    context: ContextParallel | Ulysses | None = None
    # train.activation_offload: the forward's saved tensors held on the host (engines/offload.py).
    offload: ActivationOffload | None = None

    def accumulate(self, boundary: bool) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def autocast(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def describe(self) -> tuple[dict[str, Any], list[str]]:
        return {}, []

    def forward_backward(self, micro_batches: list[MicroBatch], loss: LossFn, mark: Mark = no_mark) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        n = len(micro_batches)
        for i, (inputs, targets) in enumerate(micro_batches):
            inputs, targets = inputs.to(self.device, non_blocking=True), self._targets(targets)
            with self.accumulate(boundary=i == n - 1):
                with self.autocast(), self.offload() if self.offload else nullcontext():
                    value = loss(self.model(inputs) if self.teacher is None else self._with_teacher(inputs), targets)
                mark("forward")
                # Mean over the window: every micro-batch holds the same number of tokens
                # (fine-tuning records: the loss is weighted by its trained targets, training/trainer.py).
                self.backward(value / n)
                mark("backward")
            total += value.detach()
        return total / n

    def evaluate(self, micro_batches: list[MicroBatch], loss: LossFn) -> tuple[torch.Tensor, torch.Tensor]:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        was_training = self.model.training
        self.model.eval()  # dropout off (a Hugging Face model's, LoRA's)
        try:
            with torch.no_grad():
                for inputs, targets in micro_batches:
                    inputs, targets = inputs.to(self.device, non_blocking=True), self._targets(targets)
                    with self.autocast():
                        value = loss(self.model(inputs), targets)
                    # The micro-batch's mean back to its sum, in fp64: the mean over the whole
                    # eval set is then exact whatever the micro-batches and ranks were. Its
                    # trained targets: all, but a fine-tuning prompt's (models/loss.py).
                    count = trained(targets).double()
                    total += value.detach().double() * count
                    tokens += count
        finally:
            self.model.train(was_training)
        return total, tokens

    def _targets(self, targets: torch.Tensor) -> torch.Tensor:
        targets = targets.to(self.device, non_blocking=True)
        return targets if self.context is None else self.context.local(targets)

    def _with_teacher(self, inputs: torch.Tensor) -> tuple[Any, Any]:
        # The teacher first: its output is then the only thing of it alive during the
        # student's forward, and (as a temporary of the caller) gone once the loss has it.
        assert self.teacher is not None
        with torch.no_grad():
            taught = self.teacher(inputs)
        return self.model(inputs), taught


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The scheduled lr on every group, times the group's own lr_scale (default 1)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
