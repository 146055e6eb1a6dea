"""The bench's runs of `python -m scaletrain ...` forked from a process that has done their imports.

A bench starts scaletrain again and again (`--suite clock`: 16 configurations a round, each
predicted, then run), and a new Python spends 4-5 s of a core importing torch, DTensor, DCP,
torch._dynamo, the trainer and the launcher before a run's first step. The ranks of
`scaletrain launch` are already forked from its agent (launch/forked.py); here the command
itself is forked too. The standard library's forkserver (multiprocessing: a server process
started once, which imports the modules named as its preload, then forks a child for each
Process) runs each command in a fork made what `python -m scaletrain ARGS` would be: its
output into the log, stdin /dev/null, argv as `-m` sets it, and the CLI's own exit. The steps
a bench times are the same; only the imports before them go.

Only where a fork cannot differ from a new process: a CPU build of torch (launch/forked.py's
rule: a CUDA context does not survive a fork); the working directory and the environment the
server started with, scaletrain's own variables apart (a variable read at import, a thread
count or a kernel family, would otherwise differ); a program whose `__main__` multiprocessing
can import again in the fork (a file or a module, not `python -c`). Anywhere else the command
is a new Python, as before (`run` says None).
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

# What a run imports before its first step, imported once in the server (the CLI, the
# launcher's agent and torchrun, the trainer; torch._dynamo, which every optimizer imports).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.run",
    "scaletrain.cli",
    "scaletrain.cli.rank",
    "scaletrain.launch.torchrun",
    "scaletrain.training.trainer",
]

_server: dict[str, Any] = {}  # the context, and the environment and directory it started with


def run(args: list[str], log: Path) -> int | None:
    """`python -m scaletrain ARGS` as a fork, its stdout and stderr into `log`: its exit code,
    or None where it must be a new process (module docstring)."""
    from scaletrain.launch.forked import start_method

    if start_method() != "fork" or not _main_reloadable():
        return None
    if not _server:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _server.update(context=context, env=dict(os.environ), cwd=os.getcwd())
    if _outside_ours(os.environ) != _outside_ours(_server["env"]) or os.getcwd() != _server["cwd"]:
        return None
    log.write_bytes(b"")  # there, empty, even where the fork fails before it runs (its error: on this stderr)
    process = _server["context"].Process(target=_command, args=(list(args), str(log), dict(os.environ)), name="scaletrain")
    process.start()
    process.join()
    return process.exitcode


def _main_reloadable() -> bool:
    """Whether multiprocessing can give each fork this program's `__main__` (it imports it in the
    child, guarded by `if __name__ == "__main__"` as the standard library requires): a module
    run with -m, or a file; not `python -c` or standard input."""
    import sys

    main = sys.modules["__main__"]
    name = getattr(getattr(main, "__spec__", None), "name", None)
    return name is not None or os.path.isfile(getattr(main, "__file__", None) or "")


def _outside_ours(env: Any) -> dict[str, str]:
    """The environment but scaletrain's own variables, which it reads when it runs, never at
    import (the bench's SCALETRAIN_CACHE, one per suite): a fork takes those as they are now."""
    return {k: v for k, v in env.items() if not k.startswith("SCALETRAIN_")}


def _command(args: list[str], log: str, env: dict[str, str]) -> None:
    """In the fork: be `python -m scaletrain ARGS` with its output into `log`. The CLI ends the
    process itself (cli.main: the atexit handlers, then os._exit with its code); what it raises
    instead, a SystemExit's code or an uncaught error's traceback and 1, multiprocessing's own
    end of the process turns into the exit code as the interpreter would."""
    import gc
    import runpy
    import sys

    gc.freeze()  # the preloaded modules' objects, out of every collection's scan (launch/startup.py)
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.open(log, os.O_WRONLY | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["scaletrain", *args]
    runpy.run_module("scaletrain", run_name="__main__", alter_sys=True)
