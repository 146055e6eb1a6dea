"""`scaletrain launch --slurm / --k8s`: the sbatch script run for real with stand-ins for
srun and scontrol (two "nodes" on loopback), and the files' contents checked against what
Slurm and the Kubeflow training operator read."""

from __future__ import annotations

import math
import os
import random
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from scaletrain import checkpoint
from scaletrain.cli import main
from scaletrain.errors import UserError
from scaletrain.launch.cluster import PORT_BASE, ClusterJob, pytorchjob, sbatch_script
from scaletrain.launch.torchrun import LaunchOptions, launch_command
from scaletrain.telemetry.metrics import read_metrics

from helpers.launch import Launched, check, run
from helpers.runs import base_overrides, losses, metric_rows, run_info

# ---------------------------------------------------------------------------- stand-ins

# srun inside an allocation: the command once per "node" (all of the allocation's, or
# --nodes=N of them), here, in the background, with the variables srun sets per task. Its
# exit code is real srun's: the highest of the tasks' (128 + N for a task killed by signal
# N). The task pids go to a file, for the test to signal them as slurmstepd would.
FAKE_SRUN = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_SLURM_DIR/srun.args"
nodes=$SLURM_NNODES
while [[ $# -gt 0 && $1 == -* ]]; do
    if [[ $1 == --nodes=* ]]; then nodes=${1#--nodes=}; fi
    shift
done
pids=()
for ((i = 0; i < nodes; i++)); do
    SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" &
    pids+=("$!")
done
printf '%s\\n' "${pids[@]}" >> "$FAKE_SLURM_DIR/tasks"
rc=0
for pid in "${pids[@]}"; do
    code=0
    wait "$pid" || code=$?
    if ((code > rc)); then rc=$code; fi
done
exit "$rc"
"""

# scontrol: every "node" of the allocation is this machine; a requeue is recorded.
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1" in
    show) for ((i = 0; i < SLURM_NNODES; i++)); do echo 127.0.0.1; done ;;
    requeue) echo "$2" >> "$FAKE_SLURM_DIR/requeued" ;;
    *) echo "scontrol stand-in: '$*' not understood" >&2; exit 1 ;;
esac
"""

FAKE_SUBMIT = """#!/usr/bin/env bash
echo "$0 $*" >> "$FAKE_SLURM_DIR/submitted"
echo "Submitted batch job 4242"
"""


def fake_cluster(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("sbatch", FAKE_SUBMIT), ("kubectl", FAKE_SUBMIT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def job_id_with_free_port() -> int:
    """A job id whose rendezvous port (29500 + id % 1000, as the script derives it) is free now."""
    for _ in range(50):
        job_id = random.randrange(1000, 10**6)
        with socket.socket() as s:
            try:
                s.bind(("", PORT_BASE + job_id % 1000))
                return job_id
            except OSError:
                continue
    raise AssertionError("no free port in 29500..30499")


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def has_metrics(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.is_file() and path.read_text().endswith("\n")


# ---------------------------------------------------------------------------- for real

STEPS = 16


@pytest.mark.dist
@pytest.mark.serial  # a preemption signal against two nodes' step timing
@pytest.mark.timeout(240)
def test_sbatch_script_trains_on_two_nodes_requeues_when_signalled_and_resumes(small_dataset, tmp_path, monkeypatch, capsys):
    bin_dir = fake_cluster(tmp_path)
    run_dir, script = tmp_path / "run", tmp_path / "job.sbatch"
    monkeypatch.chdir(tmp_path)
    # Metrics every step: the test signals once the first row is there.
    args = [*base_overrides(small_dataset, run_dir, STEPS), "train.log_every=1", "train.micro_batch=2"]
    assert main(["launch", "--nproc", "1", "--nnodes", "2", "--slurm", str(script), *args]) == 0
    assert f"wrote {script}" in capsys.readouterr().out
    job_id = job_id_with_free_port()
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_SLURM_DIR": str(tmp_path),
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_CPUS_ON_NODE": "1",
    }

    # Start 1: Slurm's warning before the time limit (--signal=USR1@120) reaches the tasks,
    # each node's `scaletrain launch`, once training runs. Their torchrun agents forward it,
    # the workers save at a step they agree on and exit 75; the script requeues the job.
    job = Launched(["bash", str(script)], env=env)
    try:
        wait_for(lambda: has_metrics(run_dir), 120, "the first metrics row")
        for pid in map(int, (tmp_path / "tasks").read_text().split()):
            os.kill(pid, signal.SIGUSR1)
        first = check(job.wait(timeout=120))
    finally:
        job.kill()
    assert (tmp_path / "requeued").read_text().split() == [str(job_id)], first.stderr[-3000:]
    assert "preempted (SIGUSR1)" in first.stderr and "requeueing job" in first.stderr
    stopped = max(s for s, _ in checkpoint.complete_checkpoints(run_dir / "checkpoints"))
    assert 1 <= stopped < STEPS and len(metric_rows(run_dir)) == stopped

    # Start 2: the requeued job runs the same script and continues from that checkpoint.
    second = check(run(["bash", str(script)], env={**env, "SLURM_RESTART_COUNT": "1"}, timeout=120))
    assert "start 2" in second.stderr
    assert (tmp_path / "requeued").read_text().split() == [str(job_id)]  # not again
    info = run_info(run_dir)
    assert (info["world_size"], info["backend"]) == (2, "gloo")
    assert info["resumed_from"].endswith(f"step_{stopped}")
    rows = losses(run_dir)
    assert len(rows) == STEPS and all(math.isfinite(r) for r in rows)
    assert checkpoint.is_complete(run_dir / "checkpoints" / f"step_{STEPS}")
    # Every "node" ran the same command; the rendezvous numbered them.
    srun_args = (tmp_path / "srun.args").read_text().splitlines()
    assert len(srun_args) == 2 and f"--rdzv-endpoint 127.0.0.1:{PORT_BASE + job_id % 1000}" in srun_args[0]


# ---------------------------------------------------------------------------- contents


def slurm_job(**kw) -> ClusterJob:
    return ClusterJob(
        **{"nproc": 8, "nnodes": 4, "train_args": ("my run.yaml", "train.steps=10"), "workdir": "/shared/exp", **kw}
    )


@pytest.mark.unit
def test_sbatch_script_requeues_on_preemption_and_meets_at_the_first_node():
    text = sbatch_script(slurm_job(partition="gpu", time="2-00:00:00", gpus_per_node=8, max_restarts=2))
    directives = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")]
    for d in ["--nodes=4", "--ntasks-per-node=1", "--requeue", "--signal=USR1@120", "--open-mode=append"]:
        assert d in directives
    assert {"--partition=gpu", "--time=2-00:00:00", "--gpus-per-node=8", "--chdir=/shared/exp"} <= set(directives)
    # The directives come before the first command, or sbatch ignores them.
    first_command = next(i for i, line in enumerate(text.splitlines()[1:], 1) if line and not line.startswith("#"))
    assert all(not line.startswith("#SBATCH") for line in text.splitlines()[first_command:])
    node = next(line for line in text.splitlines() if "-m scaletrain launch" in line)
    assert '--rdzv-endpoint "$head_node:$port" --rdzv-id "$SLURM_JOB_ID" --max-restarts 2' in node
    assert node.strip().endswith(f"{shlex.quote('my run.yaml')} train.steps=10 \\")
    assert "port=$((29500 + SLURM_JOB_ID % 1000))" in text
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text
    assert "if [[ $status -eq 75 && $ended_by_slurm -eq 0 ]]" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "port=29999" in sbatch_script(slurm_job(port=29999))
    # What each node runs is launch/torchrun.py's own rendezvous command.
    cmd = launch_command(LaunchOptions(nproc=8, nnodes=4, rdzv_endpoint="node1:29501", rdzv_id="77"))
    assert {"--nnodes=4", "--rdzv-backend=c10d", "--rdzv-endpoint=node1:29501", "--rdzv-id=77"} <= set(cmd)
    assert "--standalone" not in cmd and not any(a.startswith("--node-rank") for a in cmd)
    assert any(a.startswith("--signals-to-handle=") and "SIGUSR1" in a for a in cmd)


@pytest.mark.unit
def test_sbatch_script_is_valid_bash():
    text = sbatch_script(slurm_job())
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


@pytest.mark.unit
def test_pytorchjob_has_what_the_training_operator_reads():
    job = slurm_job(image="registry/team/scaletrain:1.0", gpus_per_node=8, pvc="team-runs", workdir="", job_name="llama-7b")
    manifest = yaml.safe_load(yaml.safe_dump(pytorchjob(job)))
    assert (manifest["apiVersion"], manifest["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert manifest["metadata"]["name"] == "llama-7b"
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 3)
    for spec in specs.values():
        assert spec["restartPolicy"] == "OnFailure"
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container["image"] == "registry/team/scaletrain:1.0"
        assert {"name": "pytorchjob-port", "containerPort": 23456} in container["ports"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert container["workingDir"] == "/scaletrain"
        assert container["command"][:8] == ["python", "-m", "scaletrain", "launch", "--nproc", "8", "--nnodes", "4"]
        assert container["command"][8:12] == ["--rdzv-endpoint", "$(MASTER_ADDR):$(MASTER_PORT)", "--rdzv-id", "llama-7b"]
        assert container["command"][-2:] == ["my run.yaml", "train.steps=10"]
        volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
        assert volumes["run"]["persistentVolumeClaim"]["claimName"] == "team-runs"
    assert manifest["spec"]["runPolicy"]["backoffLimit"] >= 1
    one_node = pytorchjob(ClusterJob(nproc=1, nnodes=1, image="img"))
    assert list(one_node["spec"]["pytorchReplicaSpecs"]) == ["Master"]  # no Worker with replicas 0


@pytest.mark.unit
@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--slurm", "a.sbatch", "--k8s", "b.yaml"], ["--slurm and --k8s do not go together"]),
        (["--slurm", "a.sbatch", "--node-rank", "0"], ["--slurm does not go with --node-rank"]),
        (["--k8s", "b.yaml", "--launcher", "deepspeed"], ["--k8s does not go with --launcher deepspeed"]),
        (["--k8s", "b.yaml"], ["--k8s needs --image IMAGE"]),
        (["--k8s", "b.yaml", "--image", "i", "--job-name", "My_Job"], ["--job-name 'My_Job' is invalid for Kubernetes"]),
        (["--k8s", "b.yaml", "--image", "i", "--partition", "gpu"], ["--partition: only with --slurm"]),
        (["--slurm", "a.sbatch", "--image", "i"], ["--image and --pvc are for --k8s"]),
        (["--slurm", "a.sbatch", "--time", "1 hour"], ["--time '1 hour' is invalid", "HH:MM:SS"]),
        (["--slurm", "a.sbatch", "--submit", "--dry-run"], ["--submit does not go with --dry-run"]),
        (["--slurm", "missing/a.sbatch"], ["directory", "not found"]),
        (["--partition", "gpu"], ["--partition: only with --slurm OUT.sbatch or --k8s OUT.yaml"]),
        (["--rdzv-endpoint", "node1", "--dry-run"], ["--rdzv-endpoint 'node1' is invalid", "HOST:PORT"]),
        (["--rdzv-endpoint", "node1:70000", "--dry-run"], ["PORT in 1..65535"]),
        (
            ["--rdzv-endpoint", "node1:29500", "--master-addr", "x", "--dry-run"],
            ["--rdzv-endpoint does not go with --master-addr"],
        ),
    ],
)
def test_bad_cluster_options_are_one_line_errors(tmp_path, monkeypatch, capsys, argv, fragments):
    monkeypatch.chdir(tmp_path)
    # The config is valid and the data is there; only the options are wrong.
    assert main(["launch", "--nproc", "2", "--nnodes", "2", *argv, f"data.paths={__file__}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("scaletrain: error:"), err
    assert all(f in err[0] for f in fragments), err[0]
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.unit
def test_write_and_submit_with_stand_ins(tmp_path, monkeypatch, capsys):
    bin_dir = fake_cluster(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(tmp_path))
    data = f"data.paths={__file__}"
    assert main(["launch", "--nproc", "2", "--nnodes", "2", "--slurm", "job.sbatch", "--submit", data]) == 0
    assert "Submitted batch job 4242" in capsys.readouterr().out
    assert os.access(tmp_path / "job.sbatch", os.X_OK)
    assert main(["launch", "--nproc", "2", "--nnodes", "3", "--k8s", "job.yaml", "--image", "img", "--submit", data]) == 0
    assert yaml.safe_load((tmp_path / "job.yaml").read_text())["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    submitted = (tmp_path / "submitted").read_text().splitlines()
    assert [line.split("/")[-1] for line in submitted] == ["sbatch job.sbatch", "kubectl create -f job.yaml"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".job")]  # no temporary file left
    # Without sbatch on PATH: one line, and the script stays written.
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["launch", "--nproc", "2", "--nnodes", "2", "--slurm", "job.sbatch", "--submit", data]) == 2
    assert "--submit: sbatch not found on PATH" in capsys.readouterr().err


@pytest.mark.unit
def test_cluster_job_checks_raise_user_errors():
    with pytest.raises(UserError, match="--gpus-per-node 0 is invalid"):
        sbatch_script(slurm_job(gpus_per_node=0))
    with pytest.raises(UserError, match="holds a space or %"):
        sbatch_script(slurm_job(workdir="/my runs"))


# ---------------------------------------------------------------------------- replica groups


@pytest.mark.unit
def test_replica_groups_on_slurm_are_a_lighthouse_and_one_srun_per_group(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--ft-groups", "3", "--nproc", "8", "--nnodes", "2", "--slurm", "job.sbatch", "train.steps=10"]) == 0
    text = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --nodes=6" in text and "for ((g = 0; g < 3; g++))" in text
    lighthouse = '-m scaletrain.launch.groups --min-groups 1 --heartbeat-timeout-s 5 --port "$lighthouse_port" --store-port'
    assert lighthouse + ' "$((lighthouse_port + 1))" &' in text
    assert 'export SCALETRAIN_FT_START="${nodes[0]}:$((lighthouse_port + 1))"' in text
    assert "SCALETRAIN_FT_GROUP=$g srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --relative=$((g * 2))" in text
    assert '--rdzv-endpoint "${nodes[g * 2]}:$((port + g))" --rdzv-id "$SLURM_JOB_ID-$g" --max-restarts 3' in text
    assert 'fault_tolerance.groups=3 "fault_tolerance.lighthouse=http://${nodes[0]}:$lighthouse_port"' in text
    assert "scontrol requeue" in text and subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    assert "3 replica groups of 2 node(s) x 8 process(es)" in capsys.readouterr().out


@pytest.mark.unit
def test_replica_groups_on_kubernetes_are_a_lighthouse_service_and_one_pytorchjob_per_group(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["launch", "--ft-groups", "2", "--nproc", "4", "--nnodes", "2", "--k8s", "job.yaml", "--image", "img:1"]
    assert main([*argv, "fault_tolerance.min_groups=2", "train.steps=10"]) == 0
    deployment, service, *jobs = yaml.safe_load_all((tmp_path / "job.yaml").read_text())
    assert (deployment["kind"], service["kind"], [j["kind"] for j in jobs]) == ("Deployment", "Service", ["PyTorchJob"] * 2)
    lighthouse = deployment["spec"]["template"]["spec"]["containers"][0]
    assert lighthouse["command"][:5] == ["python", "-m", "scaletrain.launch.groups", "--min-groups", "2"]
    assert lighthouse["image"] == "img:1"
    assert service["metadata"]["name"] == "scaletrain-lighthouse"
    assert [p["port"] for p in service["spec"]["ports"]] == [29510, 29511]
    for g, job in enumerate(jobs):
        assert job["metadata"]["name"] == f"scaletrain-g{g}" and job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
        for spec in job["spec"]["pytorchReplicaSpecs"].values():
            container = spec["template"]["spec"]["containers"][0]
            assert {"name": "SCALETRAIN_FT_GROUP", "value": str(g)} in container["env"]
            assert {"name": "SCALETRAIN_FT_START", "value": "scaletrain-lighthouse:29511"} in container["env"]
            assert container["command"][-2:] == [
                "fault_tolerance.groups=2",
                "fault_tolerance.lighthouse=http://scaletrain-lighthouse:29510",
            ]
            assert "--max-restarts" in container["command"]


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_the_replica_groups_sbatch_script_trains_two_groups_that_end_equal(small_dataset, tmp_path, monkeypatch):
    """The script run for real with the stand-ins: the lighthouse from torchft's package, two
    groups of one "node" each (its own rendezvous port), both ending on the same weights."""
    bin_dir = fake_cluster(tmp_path)
    run_dir, script = tmp_path / "run", tmp_path / "job.sbatch"
    monkeypatch.chdir(tmp_path)
    args = [*base_overrides(small_dataset, run_dir, 8), "train.micro_batch=2"]
    assert main(["launch", "--ft-groups", "2", "--nproc", "1", "--slurm", str(script), *args]) == 0
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_SLURM_DIR": str(tmp_path),
        "SLURM_JOB_ID": str(job_id_with_free_port()),
    }
    check(
        run(["bash", str(script)], env={**env, "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_CPUS_ON_NODE": "1"})
    )
    ends = [
        [r for r in read_metrics(where / "metrics.jsonl", events=True) if r.get("event") == "replica_group"]
        for where in (run_dir, run_dir / "replica_groups" / "group1")
    ]
    assert len(ends[0]) == len(ends[1]) == 1 and ends[0][0]["weights_sha256"] == ends[1][0]["weights_sha256"]
    assert len(metric_rows(run_dir)) == 8 and checkpoint.is_complete(run_dir / "checkpoints" / "step_8")
