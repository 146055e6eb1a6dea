"""Host synchronisations counted op by op, for tests: `with SyncCounter() as syncs: ...`, then
`syncs.count` and `syncs.sites` (each read: the op, and the innermost frame of
src/scaletrain that made it, as "scaletrain/models/moe.py:84", else the innermost frame
outside torch; `syncs.by_site()` counts them per (op, site)).

What counts: every op that hands a tensor's value to the host, or whose output size the
host must read the data to know, as a GPU would have to wait for it:
  aten._local_scalar_dense   .item(), int(), float(), bool() (an `if` on a tensor), an index
  Tensor.tolist, Tensor.numpy   (on a CPU tensor they read memory without the dispatcher:
                             counted by wrapping them; what they dispatch inside is theirs)
  nonzero, masked_select, unique*, bincount, equal, allclose, repeat_interleave without
  output_size, indexing (or index_put_) with a boolean mask
  copies to the host: _to_copy / copy_ from another device into a CPU tensor (on a CPU
  run every tensor is already there, so these count on a GPU only)

A TorchDispatchMode sees the ops of the backward too (the autograd engine's, which no
Python frame of scaletrain calls: their site is the caller of .backward()). torch refuses
to build tensor subclasses (DTensor) under one: count around plain tensors only.
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import scaletrain

_VALUE = {"_local_scalar_dense"}
_DATA_SIZED = {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount"}
_COMPARED = {"equal", "allclose"}
_HOST_METHODS = {"tolist", "numpy"}
_TORCH = str(Path(torch.__file__).parent)
_PACKAGE = str(Path(scaletrain.__file__).parent)


class SyncCounter:
    """Counts host synchronisations while active (a context manager, reusable, not nested)."""

    def __init__(self) -> None:
        self.sites: list[tuple[str, str]] = []  # (op, where), in the order they happened
        self._inside = 0  # > 0 within a counted host method: what it dispatches is that same read
        self._mode: _Dispatch | None = None
        self._methods: dict[str, Any] = {}

    @property
    def count(self) -> int:
        return len(self.sites)

    def by_site(self) -> Counter[tuple[str, str]]:
        return Counter(self.sites)

    def __enter__(self) -> SyncCounter:
        # The host methods are wrapped on the class, not seen by a TorchFunctionMode: torch
        # leaves every mode of that kind off while one handles a call, and an activation-
        # checkpointing recompute runs inside the handling of .backward().
        for name in _HOST_METHODS:
            self._methods[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counted(name, original))
        self._mode = _Dispatch(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._mode = None
        for name, original in self._methods.items():
            setattr(torch.Tensor, name, original)
        self._methods.clear()

    def _counted(self, name: str, original: Any) -> Any:
        def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._record(f"Tensor.{name}")
            self._inside += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._inside -= 1

        return method

    def _record(self, op: str) -> None:
        self.sites.append((op, _site()))


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.counter._inside and _syncs(func, args, kwargs):
            self.counter._record(f"aten.{func.overloadpacket.__name__}")
        return func(*args, **kwargs)


def _syncs(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    name = func.overloadpacket.__name__
    if name in _VALUE or name in _DATA_SIZED or name in _COMPARED:
        return True
    if func is torch.ops.aten.repeat_interleave.Tensor:  # the other overloads come down to this one
        return kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_"):  # a boolean mask becomes indices through nonzero
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if name == "_to_copy":
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"
    if name == "copy_":
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


def _site() -> str:
    """The innermost frame of scaletrain's package (else outside torch and this file)."""
    frames = traceback.extract_stack()[:-3]  # _site, _record, the mode's handler
    for frame in reversed(frames):
        if frame.filename.startswith(_PACKAGE):
            return f"scaletrain/{Path(frame.filename).relative_to(_PACKAGE)}:{frame.lineno}"
    for frame in reversed(frames):
        if not frame.filename.startswith(_TORCH) and frame.filename != __file__:
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "?"
