"""train.nonfinite: what a step with a NaN or inf loss or gradient norm leads to.

The optimizer is never poisoned whatever the policy: every engine refuses to apply a step
whose global gradient norm is not finite (Engine.step; weights and both Adam moments stay
as they were), and a non-finite loss makes the gradients non-finite with it (NaN flows
through the softmax into every logit's gradient). This module notices such steps, agrees
on them across ranks, counts them, and says what the loop does next:

  skip      go on with the next batch (the step counts: its lr and its data are spent, as
            after an fp16 overflow); stop after `nonfinite_patience` bad steps in a row,
            since a run that only skips is not training
  rollback  after `nonfinite_patience` bad steps in a row, reload the newest valid
            checkpoint and go on with the data after the bad steps: the window from the
            checkpoint to here is skipped (PaLM's remedy for loss spikes). The same
            checkpoint three times: stop
  abort     stop at the first bad step, before anything of it is applied

Stopping is a one-line error (Diverged). The counters go into every metrics.jsonl row
and into trainer.json, so they survive a resume.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.config import TrainConfig
from scaletrain.distributed import World
from scaletrain.errors import UserError

MAX_ROLLBACKS_TO_ONE = 3


class Diverged(UserError):
    """Training stopped on non-finite steps (train.nonfinite): one line, exit code 2."""


class NonfiniteGuard:
    def __init__(self, train: TrainConfig, precision: str, world: World, saved: dict[str, int] | None = None):
        self.policy = train.nonfinite
        self.patience = train.nonfinite_patience
        self.world = world
        # With fp16 the loss scaler owns overflowing gradients (skip and halve the scale, the
        # normal start of every fp16 run): only a non-finite loss counts there.
        self.check_grad = precision != "fp16"
        self.steps = (saved or {}).get("nonfinite_steps", 0)
        self.rollbacks = (saved or {}).get("rollbacks", 0)
        self.in_a_row = 0
        self.first_bad = 0
        self._rolled_to: dict[int, int] = {}

    def counters(self) -> dict[str, int]:
        return {"nonfinite_steps": self.steps, "rollbacks": self.rollbacks}

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int, newest: Callable[[], Path | None]) -> bool:
        """Collective, after the engine's step: True when this step was non-finite on any
        rank (then: rollback due). Raises Diverged when the policy stops the run. One
        all-reduce of two flags and one host sync per step."""
        flags = torch.stack(
            [~torch.isfinite(loss.detach()), ~torch.isfinite(grad_norm.detach().to(loss.device)) & self.check_grad]
        ).float()
        if self.world.distributed:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad_loss, bad_grad = flags.tolist()
        if not (bad_loss or bad_grad):
            self.in_a_row = 0
            return False
        self.steps += 1
        self.in_a_row += 1
        self.first_bad = self.first_bad if self.in_a_row > 1 else step
        what = "loss" if bad_loss else "gradient norm"
        last = newest()
        where = f"newest checkpoint: {last}" if last else "no checkpoint yet"
        if self.policy == "abort":
            raise Diverged(
                f"step {step}: non-finite {what}; train.nonfinite=abort stopped the run before applying it ({where}); "
                "accepted: train.nonfinite=skip|rollback, or a lower train.lr / train.clip_grad"
            )
        if self.in_a_row < self.patience:
            return False
        if self.policy == "skip":
            raise Diverged(
                f"steps {self.first_bad}-{step}: {self.in_a_row} non-finite steps in a row (train.nonfinite_patience), "
                f"none applied; train.nonfinite=skip gives up ({where}); accepted: train.nonfinite=rollback, "
                "a lower train.lr, a larger train.nonfinite_patience"
            )
        if last is None:
            raise Diverged(
                f"steps {self.first_bad}-{step}: {self.in_a_row} non-finite steps in a row and no checkpoint to roll "
                "back to; accepted: checkpoint.every > 0 so that one exists, or train.nonfinite=skip"
            )
        return True

    def rolled_back(self, to_step: int) -> str:
        """Count a rollback to the checkpoint of `to_step`; the line that reports it."""
        self._rolled_to[to_step] = self._rolled_to.get(to_step, 0) + 1
        if self._rolled_to[to_step] > MAX_ROLLBACKS_TO_ONE:
            raise Diverged(
                f"steps {self.first_bad}-: non-finite again after {MAX_ROLLBACKS_TO_ONE} rollbacks to step {to_step}; "
                "the problem is not in one window of data; accepted: a lower train.lr, another checkpoint as train.resume"
            )
        self.rollbacks += 1
        bad = self.in_a_row
        self.in_a_row = 0
        return (
            f"nonfinite: {bad} non-finite step(s) in a row up to step {self.first_bad + bad - 1}; rolled back to "
            f"step {to_step} (rollback {self.rollbacks}); the data since it is skipped"
        )
