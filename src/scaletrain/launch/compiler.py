"""The compiler command DeepSpeed's CPU ops are built with on a CPU build of torch (launch/env.py
`use_build_environment` sets CXX to it): the user's compiler, with two changes that leave what
is built the same and cost less.

- No debug information: DeepSpeed compiles with `-g`, a quarter of each translation unit's
  time (async_io's deepspeed_py_aio_handle.cpp 27.4 s with, 19.9 s without; cpu_adam.cpp 34.9
  and 25.5) for symbols nobody reads.
- torch's headers parsed once per op, not once per source file: every translation unit of
  an op includes `torch/extension.h`, whose parse alone is ~29 s of a core here (`g++
  -fsyntax-only`), and async_io has 13 of them. The first source file of an op precompiles
  that header with the op's own flags (GCC's precompiled headers, under the extensions
  cache's `pch/`, one per set of flags, made once under a lock); each then compiles with it
  included first (`-include`), which changes nothing else: every source includes it anyway,
  and its include guard makes the later `#include` a no-op. Where the header cannot be
  precompiled (another compiler, an error) the source compiles as before; where a
  precompiled header does not match, GCC ignores it and reads the header itself.

The wrapper is a small script in the extensions cache. Every process that loads an op must
run the same one: ninja keys each object by its full command, and any other compiler command
rebuilds the op; torch's extension builder reads "g++" in its name.
"""

from __future__ import annotations

import os
import shlex
import sys

NAME = "g++-without-debug-info"
MIN_SOURCES = 6  # an op of fewer sources: precompiling (~70 s of one core, ~800 MB) saves less than it costs

# The script's body (stdlib only, run with -IS: no site-packages, no PYTHON* variables).
_BODY = r'''
import fcntl, hashlib, json, os, subprocess, sys

HEADER = "torch/extension.h"
SOURCES = (".cpp", ".cc", ".cxx")


def _include_dirs(args):
    for i, a in enumerate(args):
        for flag in ("-I", "-isystem"):
            if a == flag and i + 1 < len(args):
                yield args[i + 1]
            elif a.startswith(flag) and len(a) > len(flag):
                yield a[len(flag):]


def _flags(args):
    """The arguments that decide what the header compiles to: all but the source, the object and the dependency file."""
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
        elif a in ("-c", "-MD", "-MMD") or a.endswith(SOURCES):
            continue
        else:
            kept.append(a)
    return kept


def _sources_in_build():
    """How many sources the op being built has: ninja runs each compile in the op's build directory, beside build.ninja."""
    try:
        with open("build.ninja") as f:
            return sum(1 for line in f if line.startswith("build ") and ": compile " in line)
    except OSError:
        return 0


def precompiled(args):
    """The directory holding the precompiled torch/extension.h for this compile's flags, made if absent; or None."""
    if "-c" not in args or any(a.startswith("-x") for a in args) or not any(a.endswith(SOURCES) for a in args):
        return None
    real = next((os.path.join(d, HEADER) for d in _include_dirs(args) if os.path.isfile(os.path.join(d, HEADER))), None)
    if real is None or _sources_in_build() < MIN_SOURCES:
        return None
    flags = _flags(args)
    key = hashlib.sha256(json.dumps([COMPILER, flags, real, os.stat(real).st_mtime_ns]).encode()).hexdigest()[:20]
    where = os.path.join(ROOT, key)
    header = os.path.join(where, HEADER)
    made, failed = header + ".gch", os.path.join(where, "failed")
    if not os.path.exists(made) and not os.path.exists(failed):
        os.makedirs(os.path.dirname(made), exist_ok=True)
        with open(os.path.join(where, "lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the op's other sources wait for it rather than parse the header too
            if not os.path.exists(made) and not os.path.exists(failed):
                # A header of our own that includes torch's: a source's later `#include <torch/extension.h>`
                # finds it here (beside its precompiled form) and, torch's already read, reads nothing.
                with open(header, "w") as f:
                    f.write(f'#pragma once\n#include "{real}"\n')
                part = f"{made}.{os.getpid()}"
                with open(os.path.join(where, "log"), "w") as log:
                    cmd = [*COMPILER, *flags, "-x", "c++-header", header, "-o", part]
                    status = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
                if status == 0 and os.path.exists(part):
                    os.replace(part, made)
                else:
                    open(failed, "w").close()
    return where if os.path.exists(made) else None


args = [a for a in sys.argv[1:] if a != "-g"]
try:
    where = precompiled(args)
except OSError:
    where = None
if where is not None:
    # -isystem: searched after the op's own -I directories, before torch's. No object's dependency file
    # (-MMD) names the precompiled header (tests/test_launch.py), so removing it never rebuilds an op.
    args = ["-isystem", where, "-include", HEADER, *args]
os.execvp(COMPILER[0], [*COMPILER, *args])
'''


def wrapper(directory: str, compiler: str) -> str:
    """The compiler command in `directory` (module docstring) that runs `compiler`; its path.
    `compiler` already being it is kept. CXX may be a command with arguments of its own
    (`ccache g++`)."""
    path = os.path.join(directory, NAME)
    if compiler == path:
        return path
    text = (
        f"#!{sys.executable} -IS\n"
        "# scaletrain (launch/compiler.py): DeepSpeed's CPU ops' compiler, without debug information,\n"
        "# torch's extension header precompiled once per op.\n"
        f"COMPILER = {shlex.split(compiler)!r}\nROOT = {os.path.join(directory, 'pch')!r}\nMIN_SOURCES = {MIN_SOURCES}\n{_BODY}"
    )
    try:
        with open(path) as f:
            if f.read() == text:
                return path
    except OSError:
        pass
    os.makedirs(directory, exist_ok=True)
    part = f"{path}.{os.getpid()}"
    with open(part, "w") as f:
        f.write(text)
    os.chmod(part, 0o755)
    os.replace(part, path)  # atomic: a process running it meanwhile sees the old file or this one
    return path
