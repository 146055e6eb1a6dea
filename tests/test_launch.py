"""`scaletrain launch`: the launcher command it builds, and real launches of the default config."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys

import pytest

from scaletrain import checkpoint
from scaletrain.errors import UserError
from scaletrain.launch import LaunchOptions, launch_command, read_hostfile
from train_helpers import check, losses, run_scaletrain


def test_single_node_torchrun_uses_a_private_rendezvous():
    cmd = launch_command(LaunchOptions(nproc=4, train_args=("a.yaml", "train.steps=3")))
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=4"]
    assert "--standalone" in cmd
    assert cmd[-5:] == ["-m", "scaletrain", "train", "a.yaml", "train.steps=3"]


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


def test_bad_config_is_reported_once_before_launching(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "scaletrain", "launch", "--nproc", "2", "train.steps=zero"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("scaletrain: error:") == 1 and "train.steps" in proc.stderr
    assert "torch.distributed.run" not in proc.stderr  # nothing was launched


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    # The default config's data (the stdlib corpus), prepared once for the module.
    return tmp_path_factory.mktemp("default-data")


def default_config_overrides(data_dir, run_dir) -> list[str]:
    # The embedded default, shortened: only the step count and where files go differ.
    return ["train.steps=4", "checkpoint.every=2", f"data.dir={data_dir}", f"run.dir={run_dir}", "run.device=cpu"]


@pytest.mark.timeout(300)
def test_two_node_loopback_launch(data_dir, tmp_path):
    run = tmp_path / "two-nodes"
    port = str(free_port())
    common = ["launch", "--nproc", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    args = default_config_overrides(data_dir, run)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    node1 = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", *common, "--node-rank", "1", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    node0 = check(run_scaletrain([*common, "--node-rank", "0", *args]))
    out1, err1 = node1.communicate(timeout=120)
    assert node1.returncode == 0, err1[-2000:]
    assert "world 2 x cpu (gloo)" in node0.stdout
    assert len(losses(run)) == 4
    assert checkpoint.is_complete(run / "checkpoints" / "step_4")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero1", "zero2", "zero3"])
def test_launch_nproc_2_runs_the_default_config_on_every_strategy(data_dir, tmp_path, strategy):
    run = tmp_path / strategy
    proc = check(run_scaletrain(["launch", "--nproc", "2", *default_config_overrides(data_dir, run), f"parallel.strategy={strategy}"], timeout=420))
    assert f"| {strategy} | world 2 x cpu (gloo)" in proc.stdout
    rows = losses(run)
    assert len(rows) == 4 and all(math.isfinite(r) for r in rows)
    assert checkpoint.is_complete(run / "checkpoints" / "step_4")
    if strategy.startswith("zero"):
        assert (run / "deepspeed_config.json").is_file() and (run / "checkpoints" / "step_4" / "deepspeed_config.json").is_file()


@pytest.mark.timeout(600)
def test_deepspeed_launcher_runs_the_default_config(data_dir, tmp_path):
    run = tmp_path / "ds-launcher"
    args = ["launch", "--nproc", "2", "--launcher", "deepspeed", *default_config_overrides(data_dir, run), "parallel.strategy=zero2"]
    proc = check(run_scaletrain(args, timeout=420))
    assert "deepspeed.launcher.runner" in proc.stderr  # the real launcher ran, not torchrun
    assert "| zero2 | world 2 x cpu (gloo)" in proc.stdout
    assert len(losses(run)) == 4 and checkpoint.is_complete(run / "checkpoints" / "step_4")
