"""train.spikes: finite loss and gradient-norm spikes, caught and handled, each decision a row.

A spike is a value above a robust threshold over the trailing window of accepted steps:
median + `threshold` x max(1.4826 x MAD, floor x median) (the MAD scaled to a normal
distribution's sigma; the floor, `loss_floor` or `grad_norm_floor`, keeps a window of
near-equal values from flagging every wiggle). No step is judged before the window holds `min_steps`.

The loop reads the device only at the end of a log interval (docs/gpu.md), so the guard
learns the values there (`review`, beside the non-finite guard's) and its thresholds hold
until the next read. Between reads, the gradient-norm threshold goes to the engine with
each step (`limit`): a step whose global norm is above it is not applied, compared on the
device (engines/torch_engine.py), the same on every rank (the norm is global). A loss spike
is known only as the rows are read, its step already applied: it counts toward escalation.
Over the spikes of the trailing `window` steps (config/spikes.py):

  each gradient-norm spike   its update skipped (the step counts: its data is spent)
  lr_after spikes            the learning rate x lr_factor for lr_steps steps
  rollback_after spikes      back to the newest valid checkpoint, the data read since then
                             skipped (the data position stays where it is, as the
                             non-finite guard's rollback does), the window kept

Each decision is a row of metrics.jsonl ({"event": "spike", step, metric, value,
threshold, action}) with its provenance: the global sample indices of the step and, for
prepared data, the shard, offset, source file and document of each (data/loader.py
`origin`). A rollback drops the undone steps' rows: its own row carries theirs. The window,
the thresholds, the recent spikes and the lowered rate are the guard's Stateful state
(TrainerState's `spikes`), so a resume at any world size and a rollback continue with the
same decisions.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any

from scaletrain.config.spikes import SpikesSection
from scaletrain.resilience.nonfinite import MAX_ROLLBACKS_TO_ONE, Diverged

METRICS = ("loss", "grad_norm")
MAX_PENDING = 1000
MAD_TO_SIGMA = 1.4826  # a normal distribution's sigma per unit of median absolute deviation


def limit_of(values: list[float], s: SpikesSection, metric: str = "loss") -> float | None:
    """The spike threshold of `metric` over `values` (module docstring), or None while they
    are too few."""
    if len(values) < s.min_steps:
        return None
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    floor = s.loss_floor if metric == "loss" else s.grad_norm_floor
    return median + s.threshold * max(MAD_TO_SIGMA * mad, floor * abs(median))


class SpikeGuard:
    def __init__(self, s: SpikesSection, origin: Callable[[int, int], list[dict[str, Any]]] | None = None) -> None:
        self.s = s
        self.origin = origin  # (first, stop) global sample indices -> where each came from
        self.window: dict[str, list[float]] = {m: [] for m in METRICS}
        self.limits: dict[str, float | None] = {m: None for m in METRICS}
        self.recent: list[int] = []  # the steps of the spikes in the trailing window
        self.lr_until = 0  # the learning rate is lowered up to this step
        self.spikes = 0
        self.rollback_due = False
        self.samples: dict[int, tuple[int, int]] = {}  # this interval's steps: their global samples
        self.pending: list[dict[str, Any]] = []  # the latest rows: a rollback's record of those it undoes
        self._rolled_to: dict[int, int] = {}

    # -- what the loop asks between reads: no device read ---------------------------------
    def limit(self) -> float | None:
        """The gradient norm above which this step is not applied (the engine compares)."""
        return self.limits["grad_norm"] if self.s.enabled else None

    def lr_scale(self, step: int) -> float:
        return self.s.lr_factor if step <= self.lr_until else 1.0

    def took(self, step: int, first: int, stop: int) -> None:
        """Step `step` read the global samples [first, stop)."""
        if self.s.enabled:
            self.samples[step] = (first, stop)

    # -- at each read -----------------------------------------------------------------------
    def review(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The interval's step rows (as the non-finite guard reads them); returns the spike
        rows to write. Sets `rollback_due`. The same on every rank: no collective."""
        self.rollback_due = False
        events: list[dict[str, Any]] = []
        if not self.s.enabled:
            return events
        for row in rows:
            step = int(row["step"])
            if self.rollback_due:
                break  # the rest go with the rollback
            self.recent = [k for k in self.recent if k > step - self.s.window]
            spiked = [(m, float(row[m]), self.limits[m]) for m in METRICS if self._above(row.get(m), self.limits[m])]
            if not spiked:
                for m in METRICS:
                    value = row.get(m)
                    if value is not None and value == value and abs(value) != float("inf"):
                        self.window[m] = [*self.window[m], float(value)][-self.s.window :]
                continue
            self.spikes += 1
            self.recent.append(step)
            events.append(self._row(step, spiked, self._action(step, spiked)))
        for m in METRICS:
            self.limits[m] = limit_of(self.window[m], self.s, m)
        self.samples = {k: v for k, v in self.samples.items() if k > max((int(r["step"]) for r in rows), default=0)}
        self.pending = (self.pending + events)[-MAX_PENDING:]
        return events

    @staticmethod
    def _above(value: Any, limit: float | None) -> bool:
        return limit is not None and value is not None and value == value and float(value) > limit

    def _action(self, step: int, spiked: list[tuple[str, float, float | None]]) -> str:
        n = len(self.recent)
        if self.s.rollback_after and n >= self.s.rollback_after:
            self.rollback_due = True
            return "rollback"
        # The engine compared the norm with the same threshold (limits change only after a
        # review): a gradient-norm spike was not applied; a loss spike alone was.
        held = "update skipped" if any(m == "grad_norm" for m, _, _ in spiked) else "applied"
        if n >= self.s.lr_after:
            self.lr_until = step + self.s.lr_steps
            return f"{held}; lr x {self.s.lr_factor:g} to step {self.lr_until}"
        return held

    def _row(self, step: int, spiked: list[tuple[str, float, float | None]], action: str) -> dict[str, Any]:
        m, value, limit = spiked[0]
        row: dict[str, Any] = {
            "event": "spike", "step": step, "metric": m, "value": value, "threshold": limit, "action": action,
            "spikes_in_window": len(self.recent),
        }  # fmt: skip
        if len(spiked) > 1:
            row["also"] = {m2: {"value": v2, "threshold": l2} for m2, v2, l2 in spiked[1:]}
        where = self.samples.get(step)
        if where is not None:
            row["samples"] = list(where)
            if self.origin is not None:
                row["origin"] = self.origin(*where)
        return row

    def nothing_to_roll_back(self) -> Diverged:
        return Diverged(
            f"step {self.recent[-1] if self.recent else '?'}: {len(self.recent)} loss or gradient-norm spikes within "
            f"{self.s.window} steps (train.spikes.rollback_after={self.s.rollback_after}) and no valid checkpoint to roll "
            "back to; accepted: checkpoint.every > 0 so that one exists, or train.spikes.rollback_after=0"
        )

    def rolled_back(self, to_step: int, position: int) -> dict[str, Any]:
        """The row of a rollback to the checkpoint of `to_step`, the data before `position`
        skipped: it carries the undone steps' spike rows, which the truncation drops."""
        self._rolled_to[to_step] = self._rolled_to.get(to_step, 0) + 1
        if self._rolled_to[to_step] > MAX_ROLLBACKS_TO_ONE:
            raise Diverged(
                f"spikes again after {MAX_ROLLBACKS_TO_ONE} rollbacks to step {to_step}: the problem is not in one window "
                "of data; accepted: a lower train.lr, a larger train.spikes.threshold, another checkpoint as train.resume"
            )
        self.rollback_due = False
        undone, self.pending = [r for r in self.pending if r["step"] > to_step], []
        self.recent = []  # a fresh start past the data that caused them; the window stays
        return {"event": "spike", "step": to_step, "action": "rolled back", "data_skipped_to": position, "spikes": undone}

    # Stateful (training/state.py): TrainerState's `spikes`.
    def state_dict(self) -> dict[str, Any]:
        if not self.s.enabled:
            return {}
        return {
            "spikes": {
                "window": self.window, "recent": self.recent, "lr_until": self.lr_until,
                "count": self.spikes,
            }
        }  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("spikes") or {}
        if not saved or not self.s.enabled:
            return
        self.window = {m: [float(v) for v in saved["window"].get(m, [])][-self.s.window :] for m in METRICS}
        # The thresholds from the window as this config takes it (a resume may change threshold).
        self.limits = {m: limit_of(self.window[m], self.s, m) for m in METRICS}
        self.recent, self.lr_until, self.spikes = list(saved["recent"]), int(saved["lr_until"]), int(saved["count"])
