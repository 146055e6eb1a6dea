"""What a run's collaborators own of its state, and the one map a checkpoint is made from.

Each part of a run that has state a checkpoint must keep is a `Stateful` (`state_dict()` /
`load_state_dict()`, as torchtitan's CheckpointManager and Lightning Fabric take them): the
loop's position (`Position`: steps done, tokens trained, the data position; the learning-rate
schedule is a pure function of the step, optim/schedule.py, so its state is the step), the
non-finite guard's counters (resilience/nonfinite.py), the experts' bias (models/moe.py
ExpertBias), and what the run is (`Identity`: the layout, the model, the data). The run holds
them in one `{name: Stateful}` map; training/saves.py writes a checkpoint's trainer.json from
it and rollback restores through it. The engine's weights and optimizer are saved and loaded
by the engine itself (engines/base.py save/load: DCP or DeepSpeed's own files), its small
extras (the loss scale) beside them.

Each part's state_dict is a slice of TrainerState's fields (checkpoint/state.py), so the
file, its version and every checkpoint written before read as they did.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class Batches(Protocol):
    position: int  # the global sample index where the next step starts (data/loader.py)


@dataclass
class Position:
    """Where the run stands: optimizer steps done, tokens trained (fine-tuning records: their
    responses), and the data position, which the batches advance as they are read. `advance`
    and `load_state_dict` are the only writers of the step."""

    batches: Batches
    step: int = 0
    tokens_seen: int = 0

    def advance(self, tokens: int) -> int:
        """One optimizer step taken over `tokens` trained tokens; the step it was."""
        self.step += 1
        self.tokens_seen += tokens
        return self.step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "data_position": self.batches.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.batches.position = int(state["data_position"])


@dataclass(frozen=True)
class Identity:
    """What the run is, recorded in every checkpoint and checked on resume (training/rundir.py
    check_resume), never restored: a run's layout, model and data are its config's."""

    fields: Mapping[str, Any]

    def state_dict(self) -> dict[str, Any]:
        return dict(self.fields)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        del state


def state_of(parts: Mapping[str, Stateful]) -> dict[str, Any]:
    """The parts' states as one dict of TrainerState fields."""
    return {key: value for part in parts.values() for key, value in part.state_dict().items()}


def restore(parts: Mapping[str, Stateful], state: Mapping[str, Any], names: Iterable[str]) -> None:
    """The named parts' own fields of `state` (a checkpoint's TrainerState as a dict) back."""
    for name in names:
        parts[name].load_state_dict(state)
