"""train.nonfinite: what a step with a NaN or inf loss or gradient norm leads to.

The optimizer is never poisoned whatever the policy: every engine refuses to apply a step
whose global gradient norm is not finite (Engine.step; weights and both Adam moments stay
as they were), and a non-finite loss makes the gradients non-finite with it (NaN flows
through the softmax into every logit's gradient). The engines decide that on the device.
This module notices such steps where the loop reads its metrics (the end of each log
interval, and before a checkpoint, an evaluation or a rollback: docs/gpu.md), so a step
makes no host sync for it; it counts them and says what the loop does next:

  skip      go on with the next batch (the step counts: its lr and its data are spent, as
            after an fp16 overflow); stop after `nonfinite_patience` bad steps in a row,
            since a run that only skips is not training
  rollback  after `nonfinite_patience` bad steps in a row, reload the newest valid
            checkpoint and go on with the data after the interval that held them: the
            window from the checkpoint to there is skipped (PaLM's remedy for loss
            spikes). The same checkpoint three times: stop
  abort     stop at the end of the interval that holds the first bad step, which was not
            applied; nothing of the interval is saved (no checkpoint falls inside one)

Stopping is a one-line error (Diverged). The counters go into every metrics.jsonl row
and into trainer.json, so they survive a resume.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scaletrain.config import TrainConfig
from scaletrain.errors import UserError

MAX_ROLLBACKS_TO_ONE = 3


class Diverged(UserError):
    """Training stopped on non-finite steps (train.nonfinite): one line, exit code 2.

    A line that names where to go back to holds `WHERE`, filled in by `locate` with the newest
    complete checkpoint: the run's saves know it once the save in flight is complete
    (training/saves.py, as the run stops), so the guard never asks them while it reviews."""

    WHERE = "{newest checkpoint}"

    def locate(self, newest: Path | str | None) -> None:
        where = f"newest checkpoint: {newest}" if newest else "no checkpoint yet"
        self.args = tuple(str(arg).replace(self.WHERE, where) for arg in self.args)


class NonfiniteGuard:
    def __init__(self, train: TrainConfig, precision: str, saved: dict[str, int] | None = None):
        self.policy = train.nonfinite
        self.patience = train.nonfinite_patience
        # With fp16 the loss scaler owns overflowing gradients (skip and halve the scale, the
        # normal start of every fp16 run): only a non-finite loss counts there.
        self.check_grad = precision != "fp16"
        self.steps = (saved or {}).get("nonfinite_steps", 0)
        self.rollbacks = (saved or {}).get("rollbacks", 0)
        self.in_a_row = 0
        self.first_bad = 0
        self.rollback_due = False  # set by review(): the loop rolls back next
        self._rolled_to: dict[int, int] = {}

    def counters(self) -> dict[str, int]:
        return {"nonfinite_steps": self.steps, "rollbacks": self.rollbacks}

    # Stateful (training/state.py): the counters, TrainerState's `nonfinite`.
    def state_dict(self) -> dict[str, Any]:
        return {"nonfinite": self.counters()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("nonfinite") or {}
        self.steps, self.rollbacks = saved.get("nonfinite_steps", 0), saved.get("rollbacks", 0)

    def review(self, rows: list[dict[str, Any]]) -> Diverged | None:
        """The steps of a log interval, in order, as telemetry read them (rows of "step",
        "loss": the mean over ranks, non-finite when any rank's is, and "grad_norm": the
        global norm): each row gets the counters as of its step; `rollback_due` is set when
        the policy calls for a rollback. Returns the Diverged that stops the run, for the
        caller to raise once the rows are written. Host only, and the same on every rank
        (the rows are), so no collective: a step reads nothing from the device for this."""
        self.rollback_due, stop = False, None
        for row in rows:
            if stop is None and not self.rollback_due:  # after either, the rows go with the run or the rollback
                bad_loss = not math.isfinite(row["loss"])
                bad_grad = self.check_grad and not math.isfinite(row["grad_norm"])
                if bad_loss or bad_grad:
                    stop = self._bad(row["step"], "loss" if bad_loss else "gradient norm")
                else:
                    self.in_a_row = 0
            row.update(self.counters())
        return stop

    def _bad(self, step: int, what: str) -> Diverged | None:
        self.steps += 1
        self.in_a_row += 1
        self.first_bad = self.first_bad if self.in_a_row > 1 else step
        if self.policy != "abort" and self.in_a_row < self.patience:
            return None
        where = Diverged.WHERE
        if self.policy == "abort":
            # Read at the end of the log interval: the steps after it ran, and go with the run.
            return Diverged(
                f"step {step}: non-finite {what}; train.nonfinite=abort stopped the run without applying it ({where}); "
                "accepted: train.nonfinite=skip|rollback, or a lower train.lr / train.clip_grad"
            )
        if self.policy == "skip":
            return Diverged(
                f"steps {self.first_bad}-{step}: {self.in_a_row} non-finite steps in a row (train.nonfinite_patience), "
                f"none applied; train.nonfinite=skip gives up ({where}); accepted: train.nonfinite=rollback, "
                "a lower train.lr, a larger train.nonfinite_patience"
            )
        self.rollback_due = True  # the loop rolls back, or finds nothing to go back to (nothing_to_roll_back)
        return None

    def nothing_to_roll_back(self) -> Diverged:
        """The line when a rollback is due and no valid checkpoint exists (none was written, or
        every one is damaged)."""
        last = self.first_bad + self.in_a_row - 1
        return Diverged(
            f"steps {self.first_bad}-{last}: {self.in_a_row} non-finite steps in a row and no valid checkpoint to roll "
            "back to; accepted: checkpoint.every > 0 so that one exists, or train.nonfinite=skip"
        )

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
