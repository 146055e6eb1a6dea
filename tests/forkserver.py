"""A fork server for the tests' Python commands: `python -m MODULE ...` and `python SCRIPT.py ...`
started as forks of a process that has already imported what they import.

Each `scaletrain` command a test runs spends 4-6 s of a core importing torch, DCP, DTensor,
torch._dynamo, the trainer and (for ZeRO) DeepSpeed before it does anything (docs/testing.md,
"Wall time"), and the suite runs some 370 such commands beside the ranks `scaletrain launch`
already forks (launch/forked.py). This server, one per pytest process, imports all of it once
(`_preload`); helpers.launch.Launched then asks it for each command it may start this way
(`Client.start`). The command's process is a fork of the server made what a new `python` would
be (`_become`): a session of its own (as `start_new_session`), the test's files as its
stdout and stderr, /dev/null as stdin, the test's working directory and exactly the test's
environment, Python's default signal handlers, argv and sys.path as `python -m`/`python
SCRIPT` set them, and the interpreter's exit (cli.finish_process: threads, atexit, streams).

A command starts as a new process instead where a fork could differ from one: a GPU build
of torch (a CUDA context does not survive a fork); an environment that differs from the
server's in a variable read while the imports ran (`IMPORT_TIME`: kernels, threads, paths,
Python's own); a test that asks for it (`Launched(..., new_process=True)`); or everywhere
with SCALETRAIN_TEST_FORK=0, which runs the suite the old way.

Protocol (SOCK_SEQPACKET, one connection per command): the client sends the command as
JSON with its stdout and stderr descriptors; the server answers `{"pid": N}`, then
`{"status": S}` (os.waitpid's status) when the process ends, and closes. The server exits
when its standard input (a pipe from the pytest process) reaches EOF.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ENABLE_ENV = "SCALETRAIN_TEST_FORK"
# Environment variables read while the server imported torch, DeepSpeed, transformers and
# Python itself: a command whose environment differs from the server's in one of these
# starts as a new process. Anything else (RANK, SCALETRAIN_*, TORCHELASTIC_*, PATH...) is
# read when the command runs, after its environment was set.
IMPORT_TIME = (
    "PYTHON",
    "ATEN_",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "HF_",
    "TRANSFORMERS",
    "LD_",
    "MALLOC",
    "DS_",
    "NCCL_",
)
# (What the imports set themselves is compared as they left it: Client._same_imports.)
# Not those that scaletrain's launch (launch/distributed.py, torchrun.py) and torch's
# inductor (its cache directory) set while a command runs, before what reads them: a test
# that ran such code in its own process has them, and a command gets them set the same way
# whether it was forked or not.
SET_AT_RUN_TIME = frozenset({"TORCH_FR_BUFFER_SIZE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCHINDUCTOR_CACHE_DIR"})
_MAX_MESSAGE = 1 << 20


# ---------------------------------------------------------------------------- the client side


class Forked:
    """The part of subprocess.Popen that helpers.launch.Launched uses, for a forked command."""

    def __init__(self, sock: socket.socket, cmd: list[str]):
        self._sock = sock
        self.args = cmd
        self.pid = json.loads(sock.recv(_MAX_MESSAGE))["pid"]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._sock], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._sock], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile: its status is on its way
                os.kill(self.pid, signal.SIGKILL)

    def _read_status(self) -> None:
        message = self._sock.recv(_MAX_MESSAGE)
        if not message:  # the server went away: nothing will report this process
            raise RuntimeError(f"the tests' fork server ended before {self.args} did")
        self.returncode = os.waitstatus_to_exitcode(json.loads(message)["status"])
        self._sock.close()


class Client:
    """One server for this pytest process, started when first needed."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._path = ""
        self._env: dict[str, str] = {}  # the server's environment when it started
        self._imported: dict[str, str] = {}  # and once its imports were done

    def start(self, cmd: list[str], env: dict[str, str], stdout: Any, stderr: Any) -> Forked | None:
        """The command forked from the server, or None where it must be a new process."""
        if os.environ.get(ENABLE_ENV, "1") == "0" or len(cmd) < 2 or cmd[0] != sys.executable:
            return None
        if not ((cmd[1] == "-m" and len(cmd) > 2) or cmd[1].endswith(".py")):
            return None
        import torch

        if torch.version.cuda is not None or torch.version.hip is not None:
            return None
        if self._server is None or self._server.poll() is not None:
            self._start_server()
        if not self._same_imports(env):
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(self._path)
        request = {"argv": cmd[1:], "env": env, "cwd": os.getcwd()}
        socket.send_fds(sock, [json.dumps(request).encode()], [stdout.fileno(), stderr.fileno()])
        return Forked(sock, cmd)

    def _same_imports(self, env: dict[str, str]) -> bool:
        """Whether the imports would have read the same environment in a new process: each
        variable among IMPORT_TIME as the server started with it, or as its imports set it
        themselves (DeepSpeed's PYTORCH_NVML_BASED_CUDA_CHECK, say), which a new process's
        would set the same way."""
        keys = {k for e in (env, self._env, self._imported) for k in e if k.startswith(IMPORT_TIME)} - SET_AT_RUN_TIME
        return all(env.get(k) in (self._env.get(k), self._imported.get(k)) for k in keys)

    def _start_server(self) -> None:
        self._env = env_for_server()
        self._path = os.path.join(tempfile.mkdtemp(prefix="scaletrain-forkserver-"), "socket")
        log = open(os.path.join(os.path.dirname(self._path), "server.log"), "w")  # noqa: SIM115
        self._server = subprocess.Popen(
            [sys.executable, __file__, self._path], stdin=subprocess.PIPE, stdout=log, stderr=log, env=self._env
        )
        # Its stdin stays open here: the EOF when this process ends ends the server.
        # The server says it is listening by creating the socket's file.
        while not os.path.exists(self._path):
            if self._server.poll() is not None:
                raise RuntimeError(f"the tests' fork server failed to start: see {log.name}")
            select.select([], [], [], 0.05)
        self._imported = json.loads(Path(self._path + ".env").read_text())


def env_for_server() -> dict[str, str]:
    """What helpers.launch.Launched gives a command by default (one OpenMP thread), without its tag."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------------------- the server side


def _preload() -> None:
    """Import what the suite's commands import, with the collector paused as the CLI does
    (launch/startup.py), then freeze it: each fork starts with it frozen, as the CLI would."""
    import gc

    gc.disable()
    import torch._dynamo  # noqa: F401
    import torch.distributed.run  # noqa: F401  # `scaletrain launch`'s agent, and probes under torchrun

    import scaletrain.cli  # noqa: F401
    import scaletrain.cli.rank  # noqa: F401
    import scaletrain.launch.torchrun  # noqa: F401
    import scaletrain.training.eval_checkpoint  # noqa: F401
    import scaletrain.training.trainer  # noqa: F401
    from scaletrain.config import load_config
    from scaletrain.engines import preload

    # DeepSpeed's modules as a ZeRO run imports them (engines/deepspeed.py's preload), and
    # transformers' auto classes as a Hugging Face model's run does.
    preload(load_config((), ["parallel.strategy=zero2", "model.source=hf", "model.hf_config={model_type: llama}"]))
    gc.freeze()
    gc.enable()


def _serve(path: str) -> None:
    _preload()
    sys.stdout.flush()
    sys.stderr.flush()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select through wake_r
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    Path(path + ".env").write_text(json.dumps(dict(os.environ)))  # as the imports left it
    os.rename(path + ".tmp", path)  # ready
    owners: dict[int, socket.socket] = {}  # pid -> the connection its status goes to
    open_conns: list[socket.socket] = []
    while True:
        ready = select.select([sys.stdin, listener, wake_r, *open_conns], [], [])[0]
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # its socket, log and environment
            return  # pytest ended
        if listener in ready:
            open_conns.append(listener.accept()[0])
        for conn in [c for c in open_conns if c in ready]:
            message, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 2)
            open_conns.remove(conn)
            if not message:
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                server_fds = [listener.fileno(), wake_r, wake_w, conn.fileno(), *(c.fileno() for c in open_conns)]
                _become(json.loads(message), fds, server_fds)
            for fd in fds:
                os.close(fd)
            owners[pid] = conn
            conn.send(json.dumps({"pid": pid}).encode())
        if wake_r in ready:
            os.read(wake_r, 4096)
            while owners:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = owners.pop(pid)
                with contextlib.suppress(OSError):  # the test went away first
                    conn.send(json.dumps({"status": status}).encode())
                conn.close()
        del ready


def _become(request: dict[str, Any], fds: list[int], server_fds: list[int]) -> None:
    """In the fork: be `python ARGV` started by subprocess.Popen(start_new_session=True), run it, exit."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for name in _RESET:
            default = signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL  # as Python starts
            signal.signal(getattr(signal, name), signal.SIG_IGN if name in _INHERITED_IGNORED else default)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python starts
        sys.stdout.flush()
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        for fd in server_fds:  # the server's sockets and pipe (its stdin was replaced above)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    code = 1
    try:  # whatever happens, the fork never returns to the server's loop
        from scaletrain.cli import exit_as_interpreter

        code = exit_as_interpreter(lambda: _run(request["argv"]))
    finally:
        os._exit(code)


def _run(argv: list[str]) -> None:
    """`python -m MODULE ARGS` or `python SCRIPT ARGS`, as the interpreter sets argv and sys.path for them."""
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")


# What the server inherited as ignored (SIG_IGN), read before it changes any: a new process
# inherits the same from the test process that started both (a background job's shell, for
# one, ignores SIGINT), and Python leaves an ignored SIGINT ignored.
_RESET = ("SIGINT", "SIGCHLD", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
_INHERITED_IGNORED = frozenset(name for name in _RESET if signal.getsignal(getattr(signal, name)) is signal.SIG_IGN)

if __name__ == "__main__":
    _serve(sys.argv[1])
