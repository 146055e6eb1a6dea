"""scaletrain: plan, run, watch and recover distributed LLM training."""

import os
import shutil
import sys
import sysconfig

__version__ = "0.1.0"

# DeepSpeed JIT-builds its C++ ops into torch's extension cache, one directory per user,
# shared by every checkout and environment, and guarded by a lock file that a killed build
# leaves behind: every later build then waits on it forever (a CI run hung so). Inside a
# virtual environment the cache lives in it instead, beside the torch the ops are compiled
# against; `make setup` fills it and clears locks that no live build holds
# (engines/deepspeed_ops.py). An explicit TORCH_EXTENSIONS_DIR wins.
if sys.prefix != sys.base_prefix:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

# The same ninja for every build into that cache: torch's extension builder runs whichever
# `ninja` comes first on PATH, and a machine may have two (the environment's, a DeepSpeed
# dependency, 1.13; Debian's /usr/bin/ninja, 1.11). Each discards the other's build log
# (`.ninja_log` v7 against v5, other command hashes) and rebuilds every op: minutes on 2
# cores, at every switch between `.venv/bin/scaletrain` and a run with `.venv/bin` first
# on PATH. So the environment's scripts directory (where its ninja is) goes first, as
# activating the environment does; only where it holds a ninja and another one would win.
# Every process that builds imports this first: set-up, the engines, the tests, the bench,
# and the ranks torchrun starts (which inherit the PATH anyway).
_scripts = sysconfig.get_path("scripts")
_ninja = os.path.join(_scripts, "ninja")
if os.path.isfile(_ninja) and shutil.which("ninja") != _ninja:
    os.environ["PATH"] = _scripts + os.pathsep + os.environ.get("PATH", "")
del _scripts, _ninja
