"""Ranks forked from `scaletrain launch`'s agent, which has already imported what a rank needs.

A rank started as a new Python spends some 4-5 s of a core importing torch, DCP, DTensor,
torch._dynamo, the config and the trainer before its first step (docs/testing.md, "Wall
time"), every rank at every start and restart. The agent imports torch anyway; it also
imports what the command's ranks will (cli/rank.py: the same `engines.preload` a rank
runs), then torchrun starts each rank with a function entry point of its own (`--run-path`
with `--start-method=fork`: torchrun's flags) and the rank begins where the imports end.

Only where the agent's torch has no GPU support: a CUDA driver used before a fork is
unusable in the child, and on a GPU node nothing must risk that for a few seconds of
start-up, so each rank there is a new Python as torchrun starts it. `SCALETRAIN_RANK_START`
(`fork` or `exec`) overrides the choice (`fork` is refused with a GPU build).

The rank itself (cli/rank.py) is made what a new process would be by `as_new_process`.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from scaletrain.errors import UserError

START_ENV = "SCALETRAIN_RANK_START"
_STARTS = ("fork", "exec")
_forked_rank = False  # set in a rank that as_new_process made


@dataclass(frozen=True)
class ForkedRanks:
    """What `run_torchrun` needs to fork the ranks of one command."""

    script: str  # the file each rank runs (runpy.run_path, as __main__)
    preload: Callable[[], None]  # imports, in the agent, what the ranks will


def start_method() -> str:
    """`fork` or `exec` for this machine (module docstring); torch is imported by now."""
    import torch

    gpu_build = torch.version.cuda is not None or torch.version.hip is not None
    asked = os.environ.get(START_ENV, "")
    if asked and asked not in _STARTS:
        raise UserError(f"{START_ENV}={asked!r} is not understood; accepted: fork or exec")
    if asked == "fork" and gpu_build:
        raise UserError(
            f"{START_ENV}=fork is refused with a GPU build of torch (a CUDA driver used before a fork fails in the "
            "child); accepted: exec, or unset"
        )
    return asked or ("exec" if gpu_build else "fork")


def fork_command(cmd: list[str], script: str) -> list[str]:
    """torchrun's `... -m scaletrain COMMAND ARGS` as the same launch with forked ranks."""
    at = cmd.index("-m", 3)
    if cmd[at + 1] != "scaletrain":
        raise ValueError(f"not a scaletrain rank command: {cmd[at : at + 2]}")
    return [*cmd[:at], "--run-path", "--start-method=fork", script, *cmd[at + 2 :]]


def process_start() -> str:
    """`fork` in a rank forked from the agent, else `new` (run.json)."""
    return "fork" if _forked_rank else "new"


def as_new_process() -> None:
    """What the fork carried over from the agent and a new Python would not have."""
    import torch

    global _forked_rank
    _forked_rank = True
    # torchrun's agent turns these signals into exceptions of its own; a rank starts with
    # Python's defaults and installs its own handlers (resilience/preempt.py).
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # torchrun runs each rank with `python -u`: what a rank prints is on its way before a
    # kill can lose it (a hang's or an error's last lines).
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        stream.flush()
        raw = io.FileIO(stream.fileno(), "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors, write_through=True))
    # OpenMP read OMP_NUM_THREADS when the agent imported torch, which may have been before
    # torchrun set it for its ranks (1 where there are several and it was unset).
    threads = os.environ.get("OMP_NUM_THREADS", "").split(",")[0]
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
