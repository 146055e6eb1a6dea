"""Host reads of device tensors, counted (telemetry.host_syncs: a debugging aid).

On a GPU every read of a device tensor's value by the host (`.item()`, `.tolist()`, a
tensor in an `if`, a copy to CPU, an op whose output size depends on the data such as
`nonzero`) makes the host wait until the device has finished all the work queued before
it: the queue drains, and the next kernels start only as fast as Python launches them. A
step of scaletrain makes none (docs/gpu.md); the metrics are read once per log interval.

This counts them, with where each came from, so that a new one shows up at once: on the
GPU for real, and on a CPU run as the same calls (the CPU has no queue, but the code path
is the one the GPU runs). A TorchFunctionMode sees every torch call made from Python
(ours, torch's own Python, DeepSpeed's), the reading ones among them: `tolist` and
`__bool__` included, which on a CPU tensor never reach the dispatcher. Only tensors on the
run's device type count: on a GPU run a CPU tensor's value is already on the host. On CUDA
torch's own sync debug mode adds what C++ code synchronises (a kernel that reads a size
back, say), as warnings taken here; inside a call already counted they are that call.

(A TorchDispatchMode would see C++'s reads on the CPU too, but torch refuses to create
tensor subclasses under one, such as the causal masks context parallel builds.) Torch runs
an activation-checkpointing recompute without Python's modes: on a CPU its reads, the
forward's again, are not counted; on CUDA the sync debug mode, which is global, sees them.

Every torch call then goes through Python once more: a run with it on is slower.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Calls that hand a tensor's value to the host.
_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "numpy", "cpu"}
# Calls whose result's size or value the host must read the data to know.
_DATA_DEPENDENT = {
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
    "unique_consecutive",
    "bincount",  # CUDA reads the largest value back to size its output, minlength or not
    "equal",
    "allclose",
    "is_nonzero",
}
_TORCH = Path(torch.__file__).parent
_HERE = Path(__file__)
_OURS = _HERE.parents[2]  # what holds the scaletrain package
_INSTALLED = [Path(p) for p in sys.path if p.endswith(("site-packages", "dist-packages"))]

_host_only = 0  # > 0 inside host_only(): nothing there is counted


@contextlib.contextmanager
def host_only() -> Iterator[None]:
    """Marks work on host tensors by construction (an all_gather_object on a gloo side
    group, which pickles into CPU tensors and reads their sizes): on a GPU run the count
    passes those by as CPU tensors; on a CPU run, where every tensor is on the run's
    device, this tells it the same."""
    global _host_only
    _host_only += 1
    try:
        yield
    finally:
        _host_only -= 1


class HostSyncs:
    """Counts host reads while `counting(kind)` is active; `take()` returns and resets."""

    def __init__(self, device: torch.device):
        self.device_type = device.type
        self._counts: Counter[str] = Counter()
        self._sites: Counter[str] = Counter()
        self._kind: str | None = None
        self._depth = 0  # inside a counted call: what it does is that same read

    @contextlib.contextmanager
    def counting(self, kind: str) -> Iterator[None]:
        """Count the reads made inside under `kind` ("step", "flush")."""
        outer, self._kind = self._kind, kind
        try:
            with _Calls(self), self._cuda_syncs():
                yield
        finally:
            self._kind = outer

    def take(self) -> dict[str, Any]:
        """{kind: reads, ..., "sites": {"file:line function: call": reads}} since the last take."""
        out: dict[str, Any] = {k: self._counts.get(k, 0) for k in ("step", "flush")}
        out["sites"] = dict(self._sites.most_common())
        self._counts, self._sites = Counter(), Counter()
        return out

    def _on_device(self, args: Any) -> bool:
        if _host_only:
            return False
        return any(isinstance(a, torch.Tensor) and a.device.type == self.device_type for a in _flat(args))

    def _count(self, what: str, skip: int = 2) -> None:
        assert self._kind is not None
        self._counts[self._kind] += 1
        self._sites[f"{_site(skip + 1)}: {what}"] += 1

    @contextlib.contextmanager
    def _cuda_syncs(self) -> Iterator[None]:
        if self.device_type != "cuda":
            yield
            return
        before = torch.cuda.get_sync_debug_mode()
        shown = warnings.showwarning

        def show(message: Any, category: Any, *rest: Any, **kw: Any) -> None:
            if "synchronizing operation" not in str(message):
                shown(message, category, *rest, **kw)
            elif not self._depth and not _host_only:
                self._count("cuda-sync", skip=1)

        with warnings.catch_warnings():
            warnings.simplefilter("always", UserWarning)  # every one, not once per place
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(before)


class _Calls(TorchFunctionMode):
    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        syncs = self.syncs
        if syncs._depth or not _reads(getattr(func, "__name__", ""), args, kwargs) or not syncs._on_device(args):
            return func(*args, **kwargs)
        syncs._count(getattr(func, "__name__", "?"))
        syncs._depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            syncs._depth -= 1


def _reads(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    if name in _READS or name in _DATA_DEPENDENT:
        return True
    if name == "to":  # Tensor.to(...) towards the CPU from another device
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        return target is not None and torch.device(target).type == "cpu" and args[0].device.type != "cpu"
    if name == "repeat_interleave":  # its output size is the repeats' sum, unless given
        return kwargs.get("output_size") is None and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor)
    if name in ("__getitem__", "__setitem__"):  # a boolean mask as the index: a data-dependent size
        return any(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in _flat(args[1:2]))
    return False


def _flat(args: Any) -> Iterator[Any]:
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _site(skip: int) -> str:
    """Where the read was made: the innermost frame outside torch (and outside this file),
    with the innermost scaletrain frame after it when that is another one (a read inside
    DeepSpeed, say, and the line of ours that called into it)."""
    frame = sys._getframe(skip)
    culprit, ours = None, None
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path != _HERE and not path.is_relative_to(_TORCH) and "warnings" not in path.name:
            where = f"{_short(path)}:{frame.f_lineno} {frame.f_code.co_qualname}"
            culprit = culprit or where
            if path.is_relative_to(_OURS / "scaletrain"):
                ours = where
                break
        frame = frame.f_back  # type: ignore[assignment]
    if culprit is None:
        return "torch"
    return culprit if ours in (None, culprit) else f"{culprit} via {ours}"


def _short(path: Path) -> str:
    """A file as its package names it: scaletrain/..., or relative to site-packages."""
    for root in (_OURS, *_INSTALLED):
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return path.name
