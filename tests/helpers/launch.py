"""How tests start processes, and how they read what a run wrote.

One launcher for everything: the CLI as users run it (`scaletrain train`, `scaletrain
launch --nproc N`) and the probe programs under tests/probes (torchrun --standalone, so
torchrun picks its own free port). Each process starts in a session of its own with its
output going to files (no pipe can fill up and block it), carries a tag in its
environment, and in a `finally` every process with that tag is SIGKILLed: torchrun's
workers start sessions of their own and are re-parented when the agent dies, so neither
the process group nor the parent link finds them all, the tag does. No subprocess
outlives its test: its timeout is capped by what is left of the test's pytest-timeout
(set per test in conftest.py), so the launcher kills and reports first.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from scaletrain.cli import rank
from scaletrain.launch import forked

from forkserver import ENABLE_ENV, Client, Forked

TESTS = Path(__file__).resolve().parents[1]


PROBES = TESTS / "probes"
HELPERS = TESTS / "helpers"


_TAG = "SCALETRAIN_TEST_TAG"


_MARGIN_S = 10.0  # what a test keeps for itself after its last subprocess was killed


_deadline = float("inf")


_forks = Client()  # this pytest process's fork server (tests/forkserver.py)


def set_deadline(seconds_from_now: float) -> None:
    global _deadline
    _deadline = time.monotonic() + seconds_from_now


class Launched:
    """A started process tree whose output goes to files."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None, one_thread: bool = True, new_process: bool = False):
        self.cmd = cmd
        self.tag = uuid.uuid4().hex
        self._dir = tempfile.TemporaryDirectory(prefix="scaletrain-test-")
        # Open for the life of the process (closed in __del__): files, not pipes, so a chatty
        # process never blocks on a full pipe nobody reads.
        self._out = open(Path(self._dir.name) / "stdout", "w+")  # noqa: SIM115
        self._err = open(Path(self._dir.name) / "stderr", "w+")  # noqa: SIM115
        full_env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if one_thread else {}), **(env or {}), _TAG: self.tag}
        # A Python command forks from the server that has its imports done, unless the test
        # asks for a new process or the fork could differ from one (forkserver.py).
        forked = None if new_process else _forks.start(cmd, full_env, self._out, self._err)
        self.proc: subprocess.Popen | Forked = forked or subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._out, stderr=self._err, text=True, env=full_env, start_new_session=True
        )

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        limit = min(timeout, _deadline - time.monotonic() - _MARGIN_S)
        try:
            self.proc.wait(timeout=max(limit, 1.0))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"timed out after {limit:.0f} s: {' '.join(self.cmd)}\n{self._read(self._err)[-3000:]}"
            ) from None
        finally:
            self.kill()
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, self._read(self._out), self._read(self._err))

    def kill(self) -> None:
        for pid in {*_tagged(self.tag), *_in_session(self.proc.pid)}:
            with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @staticmethod
    def _read(f: Any) -> str:
        f.flush()
        f.seek(0)
        return f.read()

    def __del__(self) -> None:
        self.kill()
        self._out.close()
        self._err.close()
        self._dir.cleanup()


def _tagged(tag: str) -> list[int]:
    needle = f"{_TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if needle in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
            except OSError:  # gone meanwhile, or not ours
                pass
    return found


def _in_session(sid: int) -> list[int]:
    """The processes in session `sid` (the one each Launched process starts): a forked
    command's descendants, whose /proc/PID/environ is the fork server's, without the tag."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            # pid (comm) state ppid pgrp session ...: comm may hold spaces, so after its ')'.
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                found.append(int(entry))
    return found


def run(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300, one_thread: bool = True, new_process: bool = False
) -> subprocess.CompletedProcess:
    """Run to completion (or to the timeout, then kill the whole tree and fail)."""
    return Launched(cmd, env, one_thread, new_process).wait(timeout)


def scaletrain(args: list[str], **kw: Any) -> subprocess.CompletedProcess:
    """`scaletrain ARGS` in one process, as a user types it."""
    return run([sys.executable, "-m", "scaletrain", *args], **kw)


def train(args: list[str], nproc: int = 1, **kw: Any) -> subprocess.CompletedProcess:
    """`scaletrain train ARGS`, or `scaletrain launch --nproc N ARGS` for N ranks."""
    if nproc == 1:
        return scaletrain(["train", *args], **kw)
    return scaletrain(["launch", "--nproc", str(nproc), *args], **kw)


def torchrun(args: list[str], nproc: int) -> list[str]:
    """torchrun with a private rendezvous on a port it picks itself, running `-m scaletrain ...`
    or a probe `SCRIPT.py ...` on each rank.

    Where ranks may be forked (a CPU build of torch: launch/forked.py's rule, and the suite's
    forks not turned off), torchrun forks them from its agent (`--run-path
    --start-method=fork`, torchrun's own flags), as `scaletrain launch` does: the agent is
    itself forked from the suite's server (forkserver.py), so a rank starts with the imports
    done instead of spending 4-5 s of a core on them. `-m scaletrain` runs scaletrain's own
    rank file (cli/rank.py); a probe runs through helpers/forked_rank.py."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    if os.environ.get(ENABLE_ENV, "1") == "0" or forked.start_method() != "fork":
        return cmd
    if args[:2] == ["-m", "scaletrain"]:
        return forked.fork_command(cmd, rank.SCRIPT)
    at = len(cmd) - len(args)
    return [*cmd[:at], "--run-path", "--start-method=fork", str(HELPERS / "forked_rank.py"), *args]


def probe_command(name: str, args: list[str], nproc: int = 1) -> list[str]:
    script = str(PROBES / f"{name}.py")
    return [sys.executable, script, *args] if nproc == 1 else torchrun([script, *args], nproc)


def probe(name: str, args: list[str], out: Path, nproc: int = 1, **kw: Any) -> list[dict[str, Any]]:
    """Run tests/probes/NAME.py on `nproc` ranks; each rank writes `out/rank<R>.json`, returned by rank."""
    out.mkdir(parents=True, exist_ok=True)
    check(run(probe_command(name, ["--out", str(out), *args], nproc), **kw))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2, no traceback, exactly one stderr line, holding every fragment."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error:"), proc.stderr[-3000:]
    missing = [f for f in fragments if f not in lines[0]]
    assert not missing, f"{missing} not in {lines[0]!r}"
    return lines[0]
