"""Pipeline parallelism with torch.distributed.pipelining, composed with FSDP2 (fsdp.py).

The model is cut into stages by blocks; each rank of a pipeline group runs one stage (gpipe,
1f1b) or two (the interleaved, looped and zero-bubble schedules), and torch's schedule
owns forward and backward of every micro-batch of the accumulation window. A stage is the
built-in model with the other stages' blocks removed and the embedding (first stage only)
or the final norm and head (last stage only) set to None, so every parameter keeps its
full model name ("layers.7.attention.wq.weight") and DCP checkpoints reshard between
pipeline layouts without a name map.

What pipelining changes for the rest of scaletrain, all handled here:
* the loss exists only on the last stage: it is summed over the pipeline group, so every
  rank reports (and the non-finite guard judges) the same number;
* the gradient norm is the square root of the squared norms summed over the stages;
* the engine-neutral state is gathered over the stages (each holds its own parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.config.stages import SCHEDULES, ideal_bubble
from scaletrain.models.loss import trained


class MergedStages(nn.Module):
    """A rank's stages seen as one module with the full model's names (embedding, the blocks
    of all its stages, final norm and head, whichever it holds): what the optimizer,
    checkpoints and guards see. Forward is never called on it; the stages run."""

    def __init__(self, stages: Sequence[nn.Module]):
        super().__init__()
        layers = nn.ModuleDict()
        for stage in stages:
            for name, child in stage.named_children():
                if name == "layers":
                    for key, block in child.named_children():
                        layers[key] = block
                elif child is not None:
                    setattr(self, name, child)
        self.layers = layers
        # The stages themselves (a plain list: not registered again), whose forwards count
        # a mixture of experts' routing (models/moe.py routing_stats and ExpertBias find them here).
        self.stages = list(stages)


def _stage_class() -> type:
    """torch's PipelineStage, whose shape inference does not count as training. torch 2.13
    infers the stages' shapes at the first step (and after a switch between eval and
    training) by running each stage's forward with gradients on real tensors: a mixture of
    experts would count that forward's routing as a training step's (telemetry, and the
    load that moves model.moe.balance=bias). Earlier versions inferred on the meta device
    under no_grad, which counts nothing, and have no such method to wrap."""
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            holders = [m for m in self.submod.modules() if "moe_counting" in vars(m)]
            for m in holders:
                setattr(m, "moe_counting", False)  # noqa: B010  # a Llama's, absent from the type nn.Module
            try:
                return super()._forward_metadata_inference(*args, **kwargs)
            finally:
                for m in holders:
                    setattr(m, "moe_counting", True)  # noqa: B010

    return Stage


class Pipeline:
    """This rank's stages, the schedule that drives them, and the cross-stage reductions."""

    def __init__(
        self,
        parts: list[nn.Module],
        ids: list[int],
        ranges: list[range],
        schedule: str,
        micro_batches: int,
        group: dist.ProcessGroup,
        device: torch.device,
    ):
        from torch.distributed import pipelining

        self.group, self.device, self.parts = group, device, parts
        self.schedule_name, self.micro_batches, self.ranges = schedule, micro_batches, ranges
        n_stages = len(ranges)  # each the blocks of one stage
        self._loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None  # this step's (run)
        self.has_first, self.has_last = 0 in ids, n_stages - 1 in ids
        stages = [_stage_class()(p, i, n_stages, device, group=group) for p, i in zip(parts, ids)]
        cls = getattr(pipelining.schedules, SCHEDULES[schedule][0])
        one = SCHEDULES[schedule][1] == 1
        # scale_grads: each micro-batch's loss is its mean, so the summed gradients are
        # divided by the number of micro-batches: the window mean, as without a pipeline.
        self.schedule = cls(stages[0] if one else stages, n_microbatches=micro_batches, loss_fn=self._call_loss, scale_grads=True)
        # The classic estimate (stages.ideal_bubble): torch's own timetables drop the idle
        # slots of gpipe and 1f1b, so they cannot be counted from the schedule.
        self.bubble = ideal_bubble(dist.get_world_size(group), micro_batches, SCHEDULES[schedule][1])

    def describe(self) -> tuple[dict[str, Any], list[str]]:
        """run.json's "pipeline" entry (the first and last block of each stage), and the start-up line."""
        info: dict[str, Any] = {
            "schedule": self.schedule_name,
            "stages": [[r.start, r.stop - 1] for r in self.ranges],
            "micro_batches": self.micro_batches,
            "bubble": round(self.bubble, 4),
        }
        stages = " | ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else f"{r.start}" for r in self.ranges)
        line = (
            f"pipeline: {self.schedule_name}, {len(self.ranges)} stages of blocks {stages}, {self.micro_batches} "
            f"micro-batches per step: ranks idle {self.bubble:.0%} of a step (the bubble; more micro-batches shrink it)"
        )
        return {"pipeline": info}, [line]

    def _call_loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        assert self._loss is not None
        return self._loss(output, targets)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, loss: Callable[[Any, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One step of the schedule over the whole window (`inputs` and `targets`: the
        micro-batches concatenated, which the schedule splits again) with this step's
        `loss` (fault injection may wrap it); the mean loss, on every rank."""
        self._loss = loss
        losses: list[torch.Tensor] = []
        args = (inputs.to(self.device),) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": targets.to(self.device), "losses": losses} if self.has_last else {}
        # return_outputs=False: the last stage would otherwise concatenate every
        # micro-batch's logits, which nobody reads.
        self.schedule.step(*args, return_outputs=False, **kwargs)
        if losses:
            mean = torch.stack([v.detach().float() for v in losses]).mean()
        else:
            mean = torch.zeros((), device=self.device)
        dist.all_reduce(mean, group=self.group)  # only the last stage's rank adds a non-zero
        return mean

    def evaluate(
        self, inputs: torch.Tensor, targets: torch.Tensor, loss: Callable[[Any, torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only, through the schedule's eval path (the same micro-batches, no
        backward), the stages in eval mode: the last stage's sum of per-token losses and its
        token count (fp64), zeros on the other stages. torch re-initializes the stages when
        the schedule switches between eval and training (a shape inference each way)."""
        self._loss = loss
        losses: list[torch.Tensor] = []
        args = (inputs.to(self.device),) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": targets.to(self.device), "losses": losses} if self.has_last else {}
        modes = [part.training for part in self.parts]
        for part in self.parts:
            part.eval()
        try:
            with torch.no_grad():
                self.schedule.eval(*args, return_outputs=False, **kwargs)
        finally:
            for part, mode in zip(self.parts, modes):
                part.train(mode)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if not losses:
            return total, torch.zeros((), dtype=torch.float64, device=self.device)
        # The schedule splits the window evenly; each part's trained targets (models/loss.py).
        counts = [trained(part).double() for part in targets.to(self.device).chunk(len(losses))]
        for value, count in zip(losses, counts):
            total += value.detach().double() * count
        return total, torch.stack(counts).sum()

    def total_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over every stage from this rank's stages' norm."""
        squared = norm.float().square()
        dist.all_reduce(squared, group=self.group)
        return squared.sqrt()

    def gather(self, state: dict[str, Any]) -> dict[str, Any]:
        """Collective over the pipeline group: the union of every stage's dict (keys are
        full model names, so no stage's keys collide with another's)."""
        parts: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(parts, state, group=self.group)
        merged: dict[str, Any] = {}
        for part in parts:
            for key, value in part.items():
                merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
        return merged
