"""`scaletrain launch`: the launcher command it builds; real runs of the embedded default config.

`make demo` itself (the embedded default's 300 steps, as the Makefile runs them, learning at
least 1 nat) is tests/test_readme.py's. Here the mixture-of-experts preset learns in 30 of
the demo's steps, and the default config runs under the launchers. The default's data (the
stdlib corpus, a tokenizer trained on it) is prepared once for the module, by whichever of
its runs comes first."""

from __future__ import annotations

import math
import os
import shutil
import subprocess

import pytest
import torch

from scaletrain import checkpoint
from scaletrain.errors import UserError
from scaletrain.launch import forked
from scaletrain.launch.compiler import MIN_SOURCES
from scaletrain.launch.compiler import NAME as NO_DEBUG_CXX
from scaletrain.launch.env import deepspeed_arch_list, use_build_environment
from scaletrain.launch.torchrun import LaunchOptions, launch_command, read_hostfile

from helpers.launch import check, scaletrain, train
from helpers.runs import base_overrides, losses, metric_rows, run_info


@pytest.mark.unit
def test_single_node_torchrun_uses_a_private_rendezvous():
    cmd = launch_command(LaunchOptions(nproc=4, train_args=("a.yaml", "train.steps=3")))
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=4"]
    assert "--standalone" in cmd
    assert cmd[-5:] == ["-m", "scaletrain", "train", "a.yaml", "train.steps=3"]


@pytest.mark.unit
def test_forked_ranks_are_torchruns_own_function_entry_point(monkeypatch):
    cmd = launch_command(LaunchOptions(nproc=2, train_args=("a.yaml", "train.steps=3")))
    tail = ["--run-path", "--start-method=fork", "/r.py", "train", "a.yaml", "train.steps=3"]
    assert forked.fork_command(cmd, "/r.py") == [*cmd[:-5], *tail]
    monkeypatch.delenv(forked.START_ENV, raising=False)
    assert forked.start_method() == ("exec" if torch.version.cuda or torch.version.hip else "fork")
    monkeypatch.setenv(forked.START_ENV, "exec")
    assert forked.start_method() == "exec"
    monkeypatch.setenv(forked.START_ENV, "spawn")
    with pytest.raises(UserError, match=r"SCALETRAIN_RANK_START='spawn' is not understood; accepted: fork or exec"):
        forked.start_method()


# A forked rank must be the rank a new process would be: the same numbers bit for bit, and
# its own thread count. OMP_NUM_THREADS is unset here, as on a user's machine: torchrun sets
# it to 1 for the ranks after the agent imported torch, whose OpenMP read the environment
# then (the cores), so a forked rank that did not set it again would run with all cores.
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_forked_ranks_equal_new_processes_bit_for_bit(small_dataset, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for start in ("fork", "exec"):
        args = [*base_overrides(small_dataset, tmp_path / start, steps=4), "train.micro_batch=2", "train.log_every=1"]
        check(train(args, nproc=2, env={forked.START_ENV: start}, one_thread=False))
    fork, new = run_info(tmp_path / "fork"), run_info(tmp_path / "exec")
    assert (fork["process_start"], new["process_start"]) == ("fork", "new")
    assert fork["cpu_threads"] == new["cpu_threads"] == 1
    rows = [[(r["loss"], r["grad_norm"]) for r in metric_rows(tmp_path / start)] for start in ("fork", "exec")]
    assert len(rows[0]) == 4 and rows[0] == rows[1]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("arches", "expected"),
    [("9.0a", "9.0"), ("8.0;9.0a", "8.0;9.0"), ("9.0a+PTX 10.0f", "9.0+PTX;10.0"), ("8.6+PTX", "8.6+PTX"), ("9.0;9.0a", "9.0")],
)
def test_deepspeed_reads_the_arch_list_the_build_environment_leaves(arches, expected, monkeypatch):
    """The lent H200's image sets an arch-specific TORCH_CUDA_ARCH_LIST (`9.0a`); DeepSpeed's
    own parser (FusedAdam's first JIT build) failed on it and stopped every ZeRO run there.
    Checked with DeepSpeed's parser itself, which on a CPU machine parses and returns no flags."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = True  # the path a training process takes: FusedAdam built on first use
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arches)
    if "a" in arches or "f" in arches:  # what DeepSpeed 0.19.8 makes of the list as the image sets it
        with pytest.raises(ValueError, match="invalid literal for int"):
            builder.compute_capability_args()
    use_build_environment()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == expected == deepspeed_arch_list(arches)
    builder.compute_capability_args()  # no error


@pytest.mark.unit
def test_deepspeeds_cpu_ops_are_compiled_without_debug_information(tmp_path, monkeypatch):
    """launch/env.py: with a CPU build of torch the ops' compiler is CXX without `-g` (a
    quarter of each translation unit's time), the same command for every process."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "echo compiled:")  # a command with an argument, as `ccache g++` is
    use_build_environment()  # this environment's torch is the CPU build (+cpu)
    cxx = os.environ["CXX"]
    assert cxx == str(tmp_path / NO_DEBUG_CXX) and "g++" in os.path.basename(cxx)  # torch's compiler check reads the name
    out = subprocess.run([cxx, "-O3", "-g", "-I/a b", "-ggdb", "-c", "x.cpp"], capture_output=True, text=True, check=True)
    assert out.stdout == "compiled: -O3 -I/a b -ggdb -c x.cpp\n"  # only `-g` left out, spaces kept
    before = (tmp_path / NO_DEBUG_CXX).stat().st_mtime_ns
    use_build_environment()  # a child process inherits CXX: the same command, not a wrapper of it
    assert os.environ["CXX"] == cxx and (tmp_path / NO_DEBUG_CXX).stat().st_mtime_ns == before


@pytest.mark.unit
def test_multi_node_torchrun_needs_rank_and_master():
    cmd = launch_command(LaunchOptions(nproc=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=1234))
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=1234"} <= set(cmd)
    assert "--standalone" not in cmd
    with pytest.raises(UserError, match="needs --node-rank"):
        launch_command(LaunchOptions(nproc=8, nnodes=2))
    with pytest.raises(UserError, match="--node-rank 2 is invalid with --nnodes 2; accepted: 0..1"):
        launch_command(LaunchOptions(nproc=8, nnodes=2, node_rank=2, master_addr="h"))
    with pytest.raises(UserError, match="--nproc 0"):
        launch_command(LaunchOptions(nproc=0))


@pytest.mark.unit
def test_hostfile_gives_nodes_master_and_slots(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("# two nodes\nnode-a slots=4\nnode-b slots=4  # second\n")
    assert [h.name for h in read_hostfile(str(hf))] == ["node-a", "node-b"]
    cmd = launch_command(LaunchOptions(nproc=1, hostfile=str(hf), node_rank=1))
    assert {"--nproc-per-node=4", "--nnodes=2", "--node-rank=1", "--master-addr=node-a"} <= set(cmd)
    ds = launch_command(LaunchOptions(nproc=1, hostfile=str(hf), launcher="deepspeed"))
    assert ds[ds.index("--hostfile") + 1] == str(hf) and "--module" in ds
    hf.write_text("node-a slots=four\n")
    with pytest.raises(UserError, match="hosts:1: 'slots=four' not understood"):
        read_hostfile(str(hf))
    with pytest.raises(UserError, match="not found"):
        read_hostfile(str(tmp_path / "missing"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    # The default config's data (the stdlib corpus), prepared once for the module.
    return tmp_path_factory.mktemp("default-data")


DEMO_STEPS = 30


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_tiny_moe_learns_in_the_demos_steps(data_dir, tmp_path):
    # The demo with the mixture-of-experts preset (8 experts, top-2): `scaletrain train
    # model.preset=tiny-moe`. Measured 8.43 -> 6.50 over these 30 steps.
    run = tmp_path / "moe"
    check(train([f"run.dir={run}", f"data.dir={data_dir}", f"train.steps={DEMO_STEPS}", "model.preset=tiny-moe"], timeout=600))
    trajectory = losses(run)
    assert trajectory[-1] <= trajectory[0] - 1.0, (trajectory[0], trajectory[-1])


def default_config_overrides(data_dir, run_dir) -> list[str]:
    # The embedded default, shortened: only the step count and where files go differ.
    return ["train.steps=4", "checkpoint.every=2", f"data.dir={data_dir}", f"run.dir={run_dir}", "run.device=cpu"]


# Every multi-rank test goes through `scaletrain launch`; this one and the one below run the
# embedded default config (not the tests' small one): fsdp here, zero2 under DeepSpeed's
# launcher. Two nodes on loopback: tests/test_cluster.py (the sbatch script's c10d
# rendezvous); the --node-rank/--master-addr command is checked above.
@pytest.mark.dist
@pytest.mark.slow  # 19 s under the suite's load; every multi-rank test launches this way (fsdp: test_engine_fsdp.py)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["fsdp"])
def test_launch_nproc_2_runs_the_default_config(data_dir, tmp_path, strategy):
    run = tmp_path / strategy
    check(train([*default_config_overrides(data_dir, run), f"parallel.strategy={strategy}"], nproc=2, timeout=240))
    assert (run_info(run)["engine"], run_info(run)["world_size"], run_info(run)["backend"]) == (strategy, 2, "gloo")
    rows = losses(run)
    assert len(rows) == 4 and all(math.isfinite(r) for r in rows)
    assert checkpoint.is_complete(run / "checkpoints" / "step_4")
    if strategy.startswith("zero"):
        assert (run / "deepspeed_config.json").is_file() and (run / "checkpoints" / "step_4" / "deepspeed_config.json").is_file()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_deepspeed_launcher_runs_the_default_config(data_dir, tmp_path):
    run = tmp_path / "ds-launcher"
    proc = check(
        scaletrain(
            [
                "launch",
                "--nproc",
                "2",
                "--launcher",
                "deepspeed",
                *default_config_overrides(data_dir, run),
                "parallel.strategy=zero2",
            ],
            timeout=240,
        )
    )
    assert "deepspeed.launcher.runner" in proc.stderr  # the real launcher ran, not torchrun
    assert (run_info(run)["engine"], run_info(run)["world_size"]) == ("zero2", 2)
    assert len(losses(run)) == 4 and checkpoint.is_complete(run / "checkpoints" / "step_4")


@pytest.mark.unit
def test_an_ops_sources_compile_with_its_torch_header_precompiled_once(tmp_path, monkeypatch):
    """launch/compiler.py: with an op of many sources (its build.ninja), the first compile
    precompiles torch/extension.h with the op's flags, every source compiles with it (proved:
    the real header is then broken, its time kept, and the sources still compile), and no
    object's dependency file names it (removing it never rebuilds an op); without it a source
    compiles as before. A stand-in header (a real g++, as DeepSpeed's ops are built)."""
    from scaletrain.launch.compiler import wrapper

    include = tmp_path / "include" / "torch"
    include.mkdir(parents=True)
    real = include / "extension.h"
    real.write_text("#pragma once\n#include <vector>\ninline int answer() { return 42; }\n")
    build = tmp_path / "op"
    build.mkdir()
    (build / "build.ninja").write_text("".join(f"build s{i}.o: compile s{i}.cpp\n" for i in range(MIN_SOURCES)))
    for i in range(2):
        (build / f"s{i}.cpp").write_text(f"#include <cstdio>\n#include <torch/extension.h>\nint f{i}() {{ return answer(); }}\n")
    cxx = wrapper(str(tmp_path / "cache"), "g++")
    monkeypatch.chdir(build)

    def compile_(i: int) -> str:
        cmd = [
            cxx,
            "-MMD",
            "-MF",
            f"s{i}.o.d",
            "-isystem",
            str(tmp_path / "include"),
            "-O0",
            "-g",
            "-c",
            f"s{i}.cpp",
            "-o",
            f"s{i}.o",
        ]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return (build / f"s{i}.o.d").read_text()

    deps = compile_(0)
    made = list((tmp_path / "cache" / "pch").glob("*/torch/extension.h.gch"))
    assert len(made) == 1 and ".gch" not in deps and "pch" not in deps
    stat = real.stat()
    real.write_text("#error the real header was read again\n")
    os.utime(real, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert ".gch" not in compile_(1)  # compiled from the precompiled header alone
    assert list((tmp_path / "cache" / "pch").glob("*/torch/extension.h.gch")) == made  # made once
    shutil.rmtree(tmp_path / "cache" / "pch")
    (build / "build.ninja").write_text("build s0.o: compile s0.cpp\n")  # an op of one source: no header precompiled
    real.write_text("#pragma once\ninline int answer() { return 7; }\n")
    compile_(0)
    assert not (tmp_path / "cache" / "pch").exists()
