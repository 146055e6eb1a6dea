"""Command line: the only package that reads argv. Bad input ends in one line and exit code 2.

COMMANDS is the one table of commands: name -> the module of cli/ that holds it. Each
command module exports `add_parser(sub, name)` (its subcommand's parser) and `run(args)`
(its exit code). Their top-level imports are light (argparse, the config, the errors), so
`scaletrain --help` and a bad config are answered before torch is imported; what a command
runs (the trainer, the engines, checkpoints, the planner, diagnose) is imported once,
lazily, inside its `run`.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn, Protocol

from scaletrain import __version__
from scaletrain.cli import bench, ckpt, compare, data, diagnose, evaluate, launch, plan, train, verify, watch
from scaletrain.errors import EXIT_PREEMPTED, EXIT_USAGE, Preempted, UserError
from scaletrain.launch import startup
from scaletrain.launch.env import use_build_environment
from scaletrain.launch.torchrun import launcher_rank, report_error, report_preempted


class Command(Protocol):
    """What a command module exports."""

    def add_parser(self, sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser: ...

    def run(self, args: argparse.Namespace) -> int: ...


COMMANDS: dict[str, Command] = {
    "train": train,
    "eval": evaluate,
    "plan": plan,
    "launch": launch,
    "data": data,
    "ckpt": ckpt,
    "diagnose": diagnose,
    "compare": compare,
    "watch": watch,
    "verify": verify,
    "bench": bench,
}


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line (what is wrong, and where the help is), exit 2: not the
    usage block argparse prints first. Subcommands' parsers are of this class too
    (add_subparsers makes them of the parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"scaletrain: error: {message}; accepted: see `{self.prog} --help`\n")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="scaletrain",
        description="Plan, run, watch and recover distributed training of language models.",
        epilog="Under torchrun: torchrun --nproc-per-node N -m scaletrain train [CONFIG.yaml ...] [key=value ...]",
    )
    p.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        command.add_parser(sub, name)
    return p


def main(argv: list[str] | None = None) -> int:
    """The `scaletrain` command. Called without argv it is the process: it then ends it."""
    use_build_environment()  # DeepSpeed's op builds in the environment's cache, by its ninja (launch/env.py)
    if argv is None:
        startup.own_process()
    code = _main(sys.argv[1:] if argv is None else argv)
    if argv is None and sys.getprofile() is None and sys.gettrace() is None:  # no profiler or debugger wraps us
        _end_process(code)
    return code


def _end_process(code: int) -> None:
    """Exit without the interpreter's teardown of torch's modules: 0.6 s or more of one core
    per process after the work is done, paid by every rank, the agent and each CLI call."""
    finish_process()
    os._exit(code)


def finish_process() -> None:
    """What a normal exit does before the teardown, in its order: threading's own shutdown
    (the callbacks registered with it, such as concurrent.futures telling its pool workers
    to stop, then a join of every thread that is not a daemon), the atexit handlers
    (logging, W&B, multiprocessing, torch's), the streams flushed. A bare join of the
    threads hung forever where a ThreadPoolExecutor existed (torch.compile's): its workers
    leave only once that callback has run. Also the end of a forked rank (launch/forked.py)."""
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def exit_as_interpreter(body: Callable[[], int | None]) -> int:
    """Run `body` as a process's main code and return its exit status as the interpreter
    makes it (the returned code, a SystemExit's, 1 after an uncaught exception with its
    traceback printed), after what a normal exit does (finish_process). For a process
    that ends itself with os._exit: a forked rank (cli/rank.py), a test's forked command."""
    try:
        code = body() or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finish_process()
    return code


# The positional list each command collects its CONFIG.yaml files and key=value overrides in.
_FREE_WORDS = ("args", "overrides")


def _parse(argv: list[str]) -> argparse.Namespace:
    """argv parsed with overrides (and config files) allowed anywhere on the line: argparse
    fills a `nargs="*"` positional from one run of words only, so `plan a=1 --nodes 2 b=2`
    would leave b=2 over. What it leaves over that is not an option joins the command's
    list, in the order written; an unknown option is argparse's own one-line error."""
    parser = _parser()
    argv = _dashed_values(parser, argv)
    args, extra = parser.parse_known_args(argv)
    words = next((name for name in _FREE_WORDS if isinstance(getattr(args, name, None), list)), None)
    if not extra:
        return args
    if words is None or any(w.startswith("-") for w in extra):
        return parser.parse_args(argv)  # exits 2 naming what it does not recognise
    getattr(args, words).extend(extra)
    return args


def _dashed_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """An option's value that starts with a dash (`--gpu-memory -3GiB`) joined to it
    (`--gpu-memory=-3GiB`), so that the option's own check says what is wrong with it in one
    line instead of argparse taking the value for an option it does not know."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = commands.choices.get(argv[0]) if argv else None
    if sub is None:
        return argv
    takes_one = {o for a in sub._actions if a.nargs is None and a.option_strings for o in a.option_strings}
    known = set(sub._option_string_actions)
    out, i = [argv[0]], 1
    while i < len(argv):
        word = argv[i]
        if word in takes_one and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] not in known:
            out.append(f"{word}={argv[i + 1]}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def _main(argv: list[str]) -> int:
    # The deepspeed launcher appends --local_rank=N to each rank's arguments; the same
    # value is in the LOCAL_RANK environment variable, which is what we read.
    argv = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]
    args = _parse(argv)
    try:
        return COMMANDS[args.command].run(args)
    except UserError as e:
        # The launcher itself is no rank, whatever RANK a cluster put in its environment
        # (the Kubeflow operator sets RANK per pod): it always says what stopped it.
        report_error(str(e), 0 if args.command == "launch" else launcher_rank())
        return EXIT_USAGE
    except Preempted as e:
        report_preempted(str(e), launcher_rank())
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("scaletrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
