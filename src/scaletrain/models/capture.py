"""One block of a model and the other arguments its model passes it, for the planner's trace
(planning/activations.py): found by running the model under the caller's FakeTensorMode and
stopping at the block's first call, so any architecture's block is traced as it is called."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class _Stop(Exception):
    pass


class CapturedCall(nn.Module):
    """A block called with the other arguments its model passed it; the hidden states in,
    the hidden states out (a block returning a tuple gives its first element)."""

    def __init__(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
        super().__init__()
        self.layer = layer
        self.args = args
        self.kwargs = kwargs

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.layer(hidden, *self.args, **self.kwargs)
        return out[0] if isinstance(out, tuple) else out


def first_call(
    model: nn.Module, layer: nn.Module, seq_len: int, wrap: Callable[..., CapturedCall] = CapturedCall
) -> CapturedCall:
    """`layer` of `model`, called as `model` calls it for a [1, seq_len] batch of token ids."""
    seen: list[Any] = []

    def grab(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen[:] = [args[1:], kwargs]  # all but the hidden states
        raise _Stop

    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(torch.zeros(1, seq_len, dtype=torch.long))
    except _Stop:
        pass
    finally:
        handle.remove()
    if not seen:
        raise RuntimeError(f"{type(model).__name__}'s forward never called its first block")
    return wrap(layer, *seen)
