"""One rank of `scaletrain launch` forked from its agent (launch/forked.py): the script
torchrun's `--run-path` runs in each, and what the agent imports for them first."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from scaletrain.launch.forked import ForkedRanks

SCRIPT = str(Path(__file__).resolve())


def forked_ranks(command: str, words: list[str]) -> ForkedRanks:
    return ForkedRanks(SCRIPT, lambda: _preload(command, words))


def _preload(command: str, words: list[str]) -> None:
    """Import in the agent what COMMAND's ranks will import (the collector paused by the caller)."""
    if command == "eval":
        from scaletrain.training.eval_checkpoint import evaluate_checkpoint  # noqa: F401

        return
    from scaletrain.config import load_config, split_args
    from scaletrain.engines import preload
    from scaletrain.training.trainer import train  # noqa: F401

    preload(load_config(*split_args(words)))


def run_rank(argv: list[str]) -> None:
    """One forked rank: `scaletrain ARGV` as `python -u -m scaletrain ARGV` would run it.

    Ends the process itself unless the command succeeded: torchrun's function protocol
    reads a return value from every rank, and a failed rank's exit code is what the launcher
    reports (launch/torchrun.py)."""
    from scaletrain.cli import exit_as_interpreter, main
    from scaletrain.launch.forked import as_new_process

    as_new_process()
    code = exit_as_interpreter(lambda: main(argv))
    if code:
        os._exit(code)


if __name__ == "__main__":  # runpy's copy of this file: the rank runs in the imported module
    from scaletrain.cli import rank

    rank.run_rank(sys.argv[1:])
