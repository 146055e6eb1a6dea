"""The environment variables a launcher sets for its ranks: the one place their names live,
so the side that sets one and the side that reads it cannot drift apart; and the build
environment every process that builds DeepSpeed's ops shares."""

import os

# Restarts `scaletrain launch` made itself after an out-of-memory error (launch/torchrun.py);
# with torchrun's TORCHELASTIC_RESTART_COUNT, which attempt this is (resilience/faults.py).
RELAUNCH_ENV = "SCALETRAIN_RELAUNCH"
# Set by `run_torchrun` for its workers (launch/torchrun.py): a rank that stops on a UserError
# writes its one line into this directory instead of printing it, and the launcher prints
# each distinct line once. Without it (plain torchrun), rank 0 prints and the others stay quiet.
ERROR_DIR_ENV = "SCALETRAIN_ERROR_DIR"
# A replica group's index, 0..groups-1 (`launch --ft-groups`; resilience/replica_groups.py).
GROUP_ENV = "SCALETRAIN_FT_GROUP"
# torchft's lighthouse address, and the launcher's start barrier (launch/groups.py).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
START_ENV = "SCALETRAIN_FT_START"


def use_build_environment() -> None:
    """Where DeepSpeed builds its C++ ops, the same for every process that builds them: the
    CLI's (cli.main), a DeepSpeed engine's or bench loop's, the ops' set-up build. Called
    there, never on import: a program that imports scaletrain keeps its environment.

    DeepSpeed JIT-builds into torch's extension cache, one directory per user, shared by
    every checkout and environment, and guarded by a lock file that a killed build leaves
    behind: every later build then waits on it forever (a CI run hung so). Inside a virtual
    environment the cache lives in it instead, beside the torch the ops are compiled
    against; `make setup` fills it and clears locks that no live build holds
    (engines/deepspeed_ops.py). An explicit TORCH_EXTENSIONS_DIR wins.

    The same ninja for every build into that cache: torch's extension builder runs
    whichever `ninja` comes first on PATH, and a machine may have two (the environment's, a
    DeepSpeed dependency, 1.13; Debian's /usr/bin/ninja, 1.11). Each discards the other's
    build log (`.ninja_log` v7 against v5, other command hashes) and rebuilds every op:
    minutes on 2 cores. So the environment's scripts directory (where its ninja is) goes
    first, as activating the environment does; only where it holds a ninja and another one
    would win. The ranks a launcher starts inherit both.

    The ops a CPU build of torch builds are compiled by launch/compiler.py's wrapper of CXX:
    without debug information, and with torch's extension header precompiled once per op.

    And an architecture list DeepSpeed can read: CUDA images set TORCH_CUDA_ARCH_LIST with
    arch-specific targets such as `9.0a` (Hopper's wgmma), which torch's extension builder
    accepts but DeepSpeed 0.19.8's `compute_capability_args` parses as integers and fails on
    ("invalid literal for int() with base 10: '0a'"): every ZeRO run on the lent H200 stopped
    there, in FusedAdam's first build. DeepSpeed's ops use no arch-specific instruction, so
    the suffix goes and the number stays (`9.0a` -> `9.0`); `+PTX` and plain entries are kept.
    """
    import shutil
    import sys
    import sysconfig

    if sys.prefix != sys.base_prefix:
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    scripts = sysconfig.get_path("scripts")
    ninja = os.path.join(scripts, "ninja")
    if os.path.isfile(ninja) and shutil.which("ninja") != ninja:
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    arches = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arches:
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(arches)
    cache = os.environ.get("TORCH_EXTENSIONS_DIR")
    if cache and _cpu_only_torch():
        from scaletrain.launch.compiler import wrapper

        os.environ["CXX"] = wrapper(cache, os.environ.get("CXX", "c++"))


def _cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU build ("+cpu", as `make setup` installs it), read
    from its package metadata: the same answer in every process, whether it imported torch
    yet or not (a process that wrapped the compiler and one that did not would rebuild the
    ops in turn). CUDA builds keep their compiler as it is."""
    from importlib import metadata

    try:
        return metadata.version("torch").endswith("+cpu")
    except metadata.PackageNotFoundError:
        return False


def deepspeed_arch_list(arches: str) -> str:
    """TORCH_CUDA_ARCH_LIST with each entry as DeepSpeed parses it: `major.minor[+PTX]`, an
    arch-specific or family suffix (`9.0a`, `10.0f`) dropped, duplicates once, the order kept.
    Names DeepSpeed reads some other way (`Hopper`, a bare `9`) pass through untouched."""
    out: list[str] = []
    for entry in arches.replace(" ", ";").split(";"):
        base, plus, ptx = entry.strip().partition("+")
        major, dot, minor = base.partition(".")
        if dot and major.isdigit() and minor[:1].isdigit():
            base = f"{major}.{minor.rstrip('abcdefghijklmnopqrstuvwxyz')}"
        entry = base + plus + ptx
        if entry and entry not in out:
            out.append(entry)
    return ";".join(out)
