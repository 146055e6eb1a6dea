"""Distillation: the trained model (the student) learns a frozen teacher's next-token
distribution, the draft-beside-target setup of speculative decoding.

The teacher is a model spec like the student's. Engines build it beside the student and
shard it their own way (engines/teacher.py): it is never in the optimizer and never in a
checkpoint (a resume rebuilds it from the config, as the first start did). Each micro-batch
runs the teacher first, under no_grad, and the loss gets (student output, teacher output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.counts import ModelCounts, counts_of
from scaletrain.models.hf import final_norm as hf_final_norm
from scaletrain.models.loss import logits_of
from scaletrain.models.params import PROJECTION
from scaletrain.models.spec import LossFn, ModelSpec


@dataclass(frozen=True)
class Distill:
    teacher: ModelSpec
    temperature: float
    kl_weight: float  # the KL term's share; the rest is the student's own next-token loss
    student_loss: LossFn  # the student spec's cross entropy (chunked or not, as configured)
    hidden_weight: float = 0.0  # the hidden-state term's weight, on top; 0: off
    hidden: HiddenStates | None = None  # where the two forwards left their final hidden states

    def loss(self, output: tuple[Any, Any], targets: torch.Tensor) -> torch.Tensor:
        student, teacher = output
        # A mixture of experts returns (logits, its routers' auxiliary loss): the student's terms
        # train its routers, as its own spec's loss adds them (their gradient only: the value
        # stays the distillation loss); a teacher's are no concern of the student's.
        aux = None
        if isinstance(student, tuple):
            student, aux = student
        if isinstance(teacher, tuple):
            teacher = teacher[0]
        t = self.temperature
        # T^2 keeps the KL's gradient on the same scale as the cross entropy's whatever T
        # (the soft targets' gradients shrink as 1/T^2; Hinton et al. 2015).
        kl = kl_to_teacher(logits_of(student), logits_of(teacher), t) * (t * t)
        total = (
            kl if self.kl_weight == 1.0 else self.kl_weight * kl + (1.0 - self.kl_weight) * self.student_loss(student, targets)
        )
        if self.hidden is not None:
            total = total + self.hidden_weight * self.hidden.take_mse()
        return total if aux is None else total + (aux - aux.detach())


class HiddenStates:
    """The final hidden states (what the output head reads) of the latest student and
    teacher forwards, left here by forward hooks on each model's final norm: the student's
    already projected to the teacher's width by its `distill_proj`, inside its forward, so
    every engine gathers, shards and reduces that weight as any other of the student's."""

    def __init__(self) -> None:
        self.student: torch.Tensor | None = None
        self.teacher: torch.Tensor | None = None

    def attach_student(self, model: nn.Module) -> None:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            self.student = getattr(model, PROJECTION)(output)

        final_norm(model).register_forward_hook(hook)

    def attach_teacher(self, model: nn.Module) -> None:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            self.teacher = output

        final_norm(model).register_forward_hook(hook)

    def take_mse(self) -> torch.Tensor:
        """Mean over positions and features of (projected student - teacher)^2, in fp32;
        both are dropped here (each forward leaves new ones)."""
        assert self.student is not None and self.teacher is not None, "both forwards run before the loss"
        student, teacher = self.student, self.teacher
        self.student = self.teacher = None
        return F.mse_loss(student.float(), teacher.detach().float())


def final_norm(model: nn.Module) -> nn.Module:
    """The norm before the output head: the built-in Llama's `norm`, or the Hugging Face
    base model's last norm."""
    norm = getattr(model, "norm", None)
    if isinstance(norm, nn.Module):
        return norm
    found = hf_final_norm(model)
    if found is None:
        raise UserError(
            f"model.teacher.hidden_weight needs the final norm of {type(model).__name__}, which was not found; "
            "accepted: model.teacher.hidden_weight=0 for this model"
        )
    return found


@dataclass(frozen=True)
class WithProjection:
    """The student spec plus `distill_proj`, a trained linear map (no bias) from its hidden
    width to the teacher's, applied to its final hidden states inside its forward. The
    projection trains whatever model.trainable freezes; it is in the student's checkpoints
    and not in its Hugging Face export."""

    inner: ModelSpec
    teacher_hidden: int
    hidden: HiddenStates = field(compare=False, hash=False, repr=False)

    def __getattr__(self, name: str) -> Any:  # everything else is the student's own
        if name.startswith("__") or name == "inner":  # not yet set (copy, pickle)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def build_meta(self, max_seq_len: int) -> nn.Module:
        model = self.inner.build_meta(max_seq_len)
        with torch.device("meta"):
            model.add_module(PROJECTION, nn.Linear(self.inner.hidden_size, self.teacher_hidden, bias=False))
        self.hidden.attach_student(model)
        return model

    def config(self) -> dict[str, Any]:
        return self.inner.config() | {PROJECTION: [self.inner.hidden_size, self.teacher_hidden]}

    def counts(self) -> ModelCounts:
        return counts_of(self)  # the projection included: the planner counts its weights and state


@dataclass(frozen=True)
class Observed:
    """The teacher spec, its final hidden states left in `hidden` by every forward."""

    inner: ModelSpec
    hidden: HiddenStates = field(compare=False, hash=False, repr=False)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def build_meta(self, max_seq_len: int) -> nn.Module:
        model = self.inner.build_meta(max_seq_len)
        self.hidden.attach_teacher(model)
        return model


def kl_to_teacher(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the temperature-softened distributions, summed over the
    vocabulary and averaged over every position, in fp32 (a bf16 log-softmax over a large
    vocabulary is too coarse; the teacher's side carries no gradient)."""
    s = F.log_softmax(student.reshape(-1, student.shape[-1]).float() / temperature, dim=-1)
    with torch.no_grad():
        t = F.log_softmax(teacher.reshape(-1, teacher.shape[-1]).float() / temperature, dim=-1)
    # batchmean: the sum over the vocabulary and the positions, divided by the positions.
    return F.kl_div(s, t, reduction="batchmean", log_target=True)
