"""The start of a process the CLI owns: its heavy imports with Python's cyclic collector paused.

Importing torch, torch.distributed.checkpoint, torch._dynamo (which every torch.optim
constructor imports) and DeepSpeed makes some 300,000 objects, and the collector's
automatic full passes over that growing heap cost 0.35-0.7 s of a core per process, and
the trainer's last collection (trainer.train) 0.26 s more: about a fifth of a short run's
rank (tiny, 10 steps: 2.9 -> 2.3 s), paid by every rank at every start and restart.
What the imports make lives as long as the process, so once they are done it is frozen
(gc.freeze: left out of every later collection's scan) and the collector is back on for
the run itself, where reference cycles holding tensors must go as promptly as before.

Only where the CLI owns the process (`scaletrain ...`, `python -m scaletrain ...`): a
program that calls scaletrain's functions keeps its collector as it set it."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_owned = False


def own_process() -> None:
    """Called by the CLI's entry point when it is the process (cli.main without argv)."""
    global _owned
    _owned = True


@contextmanager
def heavy_imports() -> Iterator[None]:
    """The block's imports without the cyclic collector; afterwards what they made is frozen
    and the collector is on again. Does nothing in a process the CLI does not own, or where
    the collector was already off (whoever turned it off decides when it comes back)."""
    if not (_owned and gc.isenabled()):
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
