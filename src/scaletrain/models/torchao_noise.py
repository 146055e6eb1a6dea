"""torchao's import-time noise, kept out of a run's output.

Loading torchao 0.18.0 logs a warning per CUDA kernel library it cannot load (all of them
on a CPU-only torch; float8 training does not use them: it is torch._scaled_mm), and torch's
pytree one per enum torchao still registers (deprecated on torch 2.13). Neither is the
run's business. torchao is imported by engines/float8.py and, whenever it is installed
(the float8 extra, the test environment), by peft's own import (models/lora.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

_LOGGERS = ("torchao", "torch.utils._pytree")


@contextmanager
def quiet_torchao() -> Iterator[None]:
    """Warnings of torchao's loggers (and of torch's pytree) left out while the block imports."""
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
