"""A probe's rank forked from torchrun's agent (helpers.launch.torchrun): torchrun's `--run-path`
runs this file in each rank as `python -u SCRIPT ARGS` would run SCRIPT: the rank made what a
new process would be (scaletrain's own forked ranks' `as_new_process`), then argv, sys.path and
the run as the fork server sets them for a script (forkserver.py `_run`), its exit status the
interpreter's."""

from __future__ import annotations

import os
import sys


def run_script(script: str, args: list[str]) -> None:
    from scaletrain.cli import exit_as_interpreter
    from scaletrain.launch.forked import as_new_process

    # tests/, where forkserver.py is (the agent may be a new process without it on sys.path);
    # _run then sets sys.path[0] to the script's folder, as a new `python SCRIPT` has it.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from forkserver import _run

    as_new_process()
    code = exit_as_interpreter(lambda: _run([script, *args]))
    # A failed rank ends itself: torchrun's function protocol reads a return value from every
    # rank, and the exit code is what the agent reports (as cli/rank.py's run_rank).
    if code:
        os._exit(code)


if __name__ == "__main__":  # runpy's copy of this file, in the rank
    run_script(sys.argv[1], sys.argv[2:])
