"""A probe's rank forked from torchrun's agent (helpers.launch.torchrun): torchrun's `--run-path`
runs this file in each rank as `python -u SCRIPT ARGS` would run SCRIPT: the rank made what a
new process would be (scaletrain's own forked ranks' `as_new_process`), the script's folder
first on sys.path, its exit status the interpreter's."""

from __future__ import annotations

import os
import runpy
import sys


def run_script(script: str, args: list[str]) -> None:
    from scaletrain.cli import exit_as_interpreter
    from scaletrain.launch.forked import as_new_process

    as_new_process()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = exit_as_interpreter(lambda: runpy.run_path(script, run_name="__main__") and None)
    # A failed rank ends itself: torchrun's function protocol reads a return value from every
    # rank, and the exit code is what the agent reports (as cli/rank.py's run_rank).
    if code:
        os._exit(code)


if __name__ == "__main__":  # runpy's copy of this file, in the rank
    run_script(sys.argv[1], sys.argv[2:])
