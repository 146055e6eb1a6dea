"""Distillation: the trained model (the student) learns a frozen teacher's next-token
distribution, the draft-beside-target setup of speculative decoding.

The teacher is a model spec like the student's. Engines build it beside the student and
shard it their own way (engines/teacher.py): it is never in the optimizer and never in a
checkpoint (a resume rebuilds it from the config, as the first start did). Each micro-batch
runs the teacher first, under no_grad, and the loss gets (student output, teacher output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from scaletrain.models.loss import logits_of
from scaletrain.models.spec import LossFn, ModelSpec


@dataclass(frozen=True)
class Distill:
    teacher: ModelSpec
    temperature: float
    kl_weight: float  # the KL term's share; the rest is the student's own next-token loss
    student_loss: LossFn  # the student spec's cross entropy (chunked or not, as configured)

    def loss(self, output: tuple[Any, Any], targets: torch.Tensor) -> torch.Tensor:
        student, teacher = output
        t = self.temperature
        # T^2 keeps the KL's gradient on the same scale as the cross entropy's whatever T
        # (the soft targets' gradients shrink as 1/T^2; Hinton et al. 2015).
        kl = kl_to_teacher(logits_of(student), logits_of(teacher), t) * (t * t)
        if self.kl_weight == 1.0:
            return kl
        return self.kl_weight * kl + (1.0 - self.kl_weight) * self.student_loss(student, targets)


def kl_to_teacher(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the temperature-softened distributions, summed over the
    vocabulary and averaged over every position, in fp32 (a bf16 log-softmax over a large
    vocabulary is too coarse; the teacher's side carries no gradient)."""
    s = F.log_softmax(student.reshape(-1, student.shape[-1]).float() / temperature, dim=-1)
    with torch.no_grad():
        t = F.log_softmax(teacher.reshape(-1, teacher.shape[-1]).float() / temperature, dim=-1)
    # batchmean: the sum over the vocabulary and the positions, divided by the positions.
    return F.kl_div(s, t, reduction="batchmean", log_target=True)
