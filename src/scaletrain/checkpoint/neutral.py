"""A checkpoint's whole state in the engine-neutral layout (checkpoint/layout.py), read offline
from any format, and its weights one tensor at a time.

Any engine loads the neutral state (Engine.load_state_dict): that is how a checkpoint moves
to another world size or another engine when the engine cannot load it natively, and how
every such move is verified (checkpoint/restore.py). The formats' readers are
dcp_format.py and deepspeed_format.py.

Everything is held in memory at once (one full copy of weights and moments): fine for the
models a single host converts; a sharded, streamed path is future work (docs/checkpointing.md).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch

from scaletrain.checkpoint.formats import Tensors, reader_of
from scaletrain.checkpoint.layout import ParamLayout, State
from scaletrain.checkpoint.state import TrainerState
from scaletrain.errors import UserError

__all__ = ["ParamLayout", "State", "WeightStream", "read_state"]


def read_state(ckpt: Path, layout: ParamLayout) -> State:
    """The neutral state of the checkpoint directory `ckpt` (a checkpoints/step_<N>)."""
    state = reader_of(ckpt).read_state(ckpt / "state", layout)
    for alias, first in layout.aliases.items():  # tied weights appear under every name, as in state_dict()
        if first in state["model"]:
            state["model"].setdefault(alias, state["model"][first])
    missing = sorted(set(layout.shapes) - set(state["model"]))
    if TrainerState.read(ckpt).base is not None:  # checkpoint.frozen=reference: those come from the base, as built
        missing = [n for n in missing if n not in layout.frozen]
    if missing:
        raise UserError(f"checkpoint {ckpt} holds no weights for {', '.join(missing[:3])}; accepted: a checkpoint of this model")
    return state


class WeightStream:
    """The model weights of a checkpoint one tensor at a time (for exports whose peak memory
    must stay near the largest tensor): `with WeightStream(ckpt, layout) as w: w.get(name)`.
    `trained` names the parameters that have optimizer state (the ones training updated)."""

    def __init__(self, ckpt: Path, layout: ParamLayout):
        self.ckpt, self.layout = ckpt, layout
        self._stack = ExitStack()
        self.trained: set[str] = set()

    def __enter__(self) -> WeightStream:
        self._tensors: Tensors = reader_of(self.ckpt).open(self.ckpt / "state", self.layout, self._stack)
        self.trained = self._tensors.trained
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def holds(self, name: str) -> bool:
        """Whether the checkpoint has weights for `name` (not: a frozen parameter it left out)."""
        return self._tensors.holds(self.layout.aliases.get(name, name))

    def get(self, name: str) -> torch.Tensor:
        """fp32 weights of parameter `name` (a tied alias gives its first name's tensor)."""
        return self._tensors.get(self.layout.aliases.get(name, name))
