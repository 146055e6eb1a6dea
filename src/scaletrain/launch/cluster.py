"""`scaletrain launch --slurm / --k8s`: a batch script or a Kubeflow PyTorchJob manifest that
runs `scaletrain launch` on every node, the nodes meeting through torchrun's c10d rendezvous.

Each node runs the same `scaletrain launch --rdzv-endpoint HEAD:PORT` (launch/torchrun.py): its
torchrun agent maps the workers' exits to scaletrain's codes (75: preempted with a checkpoint
saved; 2: bad input), so the cluster side only decides what to do with those codes, and no
second torchrun command line is built here.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scaletrain.errors import EXIT_PREEMPTED, UserError

# Slurm signals the job steps this long before the time limit (`--signal=USR1@120`; Slurm
# may send it up to 60 s earlier). The workers stop one step after the signal and save;
# the agent waits SHUTDOWN_TIMEOUT_S for that (torchrun's default of 30 s is short for a
# large checkpoint) and must be done before the limit, hence a margin below the lead.
# Kubernetes gets the same grace period between its SIGTERM and its SIGKILL.
SIGNAL_LEAD_S = 120
SHUTDOWN_TIMEOUT_S = 100
PORT_BASE = 29500
# The training operator's default for the container port named "pytorchjob-port", which
# it puts into MASTER_PORT (kubeflow/training-operator v1.9.0, pytorch_types.go).
K8S_PORT = 23456
# Pod restarts the operator allows before it marks the job failed: every preemption and
# every crash of a pod counts as one.
K8S_BACKOFF_LIMIT = 10
K8S_WORKDIR = "/scaletrain"  # where --pvc is mounted, and the working directory then


@dataclass
class ClusterJob:
    nproc: int
    nnodes: int
    train_args: tuple[str, ...] = ()
    job_name: str = "scaletrain"
    max_restarts: int = 0
    port: int | None = None  # Slurm: a fixed rendezvous port; None: derived from the job id
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    gpus_per_node: int | None = None
    image: str | None = None
    pvc: str | None = None
    workdir: str = ""  # Slurm: where relative paths in train_args resolve (the cwd)
    python: str = sys.executable


# ---------------------------------------------------------------------------- checks

# sbatch's --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_SLURM_TIME = re.compile(r"\d+|\d+:\d\d|\d+:\d\d:\d\d|\d+-\d+|\d+-\d+:\d\d|\d+-\d+:\d\d:\d\d")
_SLURM_WORD = re.compile(r"[\w.,:+@-]+")  # what a #SBATCH line holds safely without quoting
# The training operator's webhook checks the job name as a DNS-1035 label (v1.9.0,
# pytorchjob_webhook.go); a PVC name is a DNS-1123 subdomain.
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_1123 = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


def _check_common(job: ClusterJob) -> None:
    if job.nproc < 1:
        raise UserError(f"--nproc {job.nproc} is invalid; accepted: processes per node >= 1")
    if job.nnodes < 1:
        raise UserError(f"--nnodes {job.nnodes} is invalid; accepted: >= 1")
    if job.max_restarts < 0:
        raise UserError(f"--max-restarts {job.max_restarts} is invalid; accepted: an integer >= 0")
    if job.gpus_per_node is not None and job.gpus_per_node < 1:
        raise UserError(f"--gpus-per-node {job.gpus_per_node} is invalid; accepted: an integer >= 1")


def check_slurm(job: ClusterJob) -> None:
    _check_common(job)
    for option, value in (("--job-name", job.job_name), ("--partition", job.partition), ("--account", job.account)):
        if value is not None and not _SLURM_WORD.fullmatch(value):
            raise UserError(f"{option} {value!r} is invalid; accepted: letters, digits and . , : + @ _ - (no spaces)")
    if job.time is not None and not _SLURM_TIME.fullmatch(job.time):
        raise UserError(f"--time {job.time!r} is invalid; accepted: MINUTES, HH:MM:SS or D-HH:MM:SS (sbatch's forms)")
    if job.port is not None and not 0 < job.port < 65536:
        raise UserError(f"--master-port {job.port} is invalid; accepted: 1..65535")
    if job.image is not None or job.pvc is not None:
        raise UserError("--image and --pvc are for --k8s; a Slurm job runs in the environment it was submitted from")
    if re.search(r"[\s%]", job.workdir):
        # #SBATCH --chdir/--output take no quoting, and % starts one of sbatch's file patterns.
        raise UserError(f"the working directory {job.workdir!r} holds a space or %; accepted: run from a directory without")


def check_k8s(job: ClusterJob) -> None:
    _check_common(job)
    if not job.image or any(c.isspace() for c in job.image):
        raise UserError(f"--k8s needs --image IMAGE (got {job.image!r}); accepted: a container image with scaletrain installed")
    if len(job.job_name) > 63 or not _DNS_1035.fullmatch(job.job_name):
        raise UserError(
            f"--job-name {job.job_name!r} is invalid for Kubernetes; accepted: up to 63 lowercase letters, digits and '-', "
            "starting with a letter"
        )
    if job.pvc is not None and (len(job.pvc) > 253 or not _DNS_1123.fullmatch(job.pvc)):
        raise UserError(f"--pvc {job.pvc!r} is invalid; accepted: the name of a PersistentVolumeClaim in the job's namespace")
    slurm_only = [o for o, v in (("--partition", job.partition), ("--account", job.account), ("--time", job.time)) if v]
    if slurm_only or job.port is not None:
        given = ", ".join(slurm_only + (["--master-port"] if job.port is not None else []))
        raise UserError(f"{given}: only with --slurm; the training operator picks the master's port and the pods' limits")


# ---------------------------------------------------------------------------- Slurm


def _node_command(job: ClusterJob, python: str, endpoint: str, rdzv_id: str) -> list[str]:
    """What every node runs; `endpoint` and `rdzv_id` may be references the node expands."""
    cmd = [python, "-m", "scaletrain", "launch", "--nproc", str(job.nproc), "--nnodes", str(job.nnodes)]
    cmd += ["--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
    if job.max_restarts:
        cmd += ["--max-restarts", str(job.max_restarts)]
    return cmd + list(job.train_args)


def sbatch_script(job: ClusterJob) -> str:
    check_slurm(job)
    node_cmd = " ".join(
        '"$head_node:$port"' if a == "@ENDPOINT@" else '"$SLURM_JOB_ID"' if a == "@ID@" else shlex.quote(a)
        for a in _node_command(job, job.python, "@ENDPOINT@", "@ID@")
    )
    title = f"`scaletrain launch --slurm`: {job.nnodes} node(s) x {processes(job)}."
    return f"""{sbatch_opening(job, job.nnodes, title, "docs/clusters.md")}
# The first node hosts torchrun's c10d rendezvous store and every node's agent meets the
# others there, so no node needs a rank of its own. (No `| head -n1`: under pipefail a
# SIGPIPE of scontrol would end the script.)
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${{nodes%%$'\\n'*}}
# Derived from the job id, so two jobs sharing a head node do not collide.
port={sbatch_port(job)}

{ENVIRONMENT}

{TERM_TRAP}

echo "scaletrain: job $SLURM_JOB_ID, start $((${{SLURM_RESTART_COUNT:-0}} + 1)), nodes $SLURM_JOB_NODELIST, rendezvous $head_node:$port" >&2
status=0
# One task per node, with all CPUs of the node (a task gets one CPU unless it asks).
# --kill-on-bad-exit=0: a node that finished its preemption save exits 75 while the
# others may still be leaving, and a kill would turn their 75 into 137.
srun --nodes={job.nnodes} --ntasks={job.nnodes} --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=0 \\
    {node_cmd} \\
    || status=$?

{REQUEUE}"""


# What every script exports, traps and does with its tasks' exit code.
ENVIRONMENT = f"""# A rendezvous store of its own for each restart of the workers (pytorch/pytorch#135712);
# `scaletrain launch` sets it too, this keeps the script right if the command is swapped.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# How long the agent waits for the workers' save after forwarding the signal.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={SHUTDOWN_TIMEOUT_S}"""
TERM_TRAP = """# Slurm's own SIGTERM to this shell (scancel, preemption, the time limit itself) means the
# job is ending and Slurm decides whether it comes back: no requeue then. A trap, not an
# ignored signal, so srun and the tasks keep the default handling.
ended_by_slurm=0
trap 'ended_by_slurm=1' TERM"""
REQUEUE = f"""if [[ $status -eq {EXIT_PREEMPTED} && $ended_by_slurm -eq 0 ]]; then
    # Preempted with a checkpoint saved: the requeued job runs this script again and
    # train.resume=auto continues from that checkpoint.
    echo "scaletrain: stopped with a checkpoint saved; requeueing job $SLURM_JOB_ID" >&2
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"
"""


def processes(job: ClusterJob) -> str:
    return f"{job.nproc} process" + ("es" if job.nproc > 1 else "")


def sbatch_port(job: ClusterJob) -> str:
    """The rendezvous port: --port, or one derived from the job id in the script."""
    return str(job.port) if job.port is not None else f"$(({PORT_BASE} + SLURM_JOB_ID % 1000))"


def sbatch_opening(job: ClusterJob, nnodes: int, title: str, docs: str) -> str:
    """Every sbatch script's first lines: who wrote it (`title`, wrapped by the caller),
    where its docs are, the #SBATCH lines, a strict shell that refuses to run outside
    Slurm, and the working directory."""
    return f"""#!/bin/bash
# Written by {title}
# Submit with: sbatch THIS_FILE (scaletrain's {docs} explains it).
{sbatch_header(job, nnodes)}

set -euo pipefail
: "${{SLURM_JOB_ID:?this is a Slurm batch script: submit it with sbatch}}"
cd {shlex.quote(job.workdir)}
"""


def sbatch_header(job: ClusterJob, nnodes: int) -> str:
    """The #SBATCH lines of a job of `nnodes` nodes, one task (torchrun's agent) on each."""
    directives = [f"--job-name={job.job_name}", f"--nodes={nnodes}", "--ntasks-per-node=1"]
    directives += [
        "# Whole nodes (all CPUs, memory): the one task per node is torchrun's agent, which",
        "# starts the --nproc workers there.",
        "--exclusive",
    ]
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    directives += [f"--{k}={v}" for k, v in (("partition", job.partition), ("account", job.account), ("time", job.time)) if v]
    directives += [
        f"--chdir={job.workdir}",
        f"--output={job.workdir}/{job.job_name}-%j.log",
        "# A requeued job appends to the same log instead of truncating it.",
        "--open-mode=append",
        "--requeue",
        f"# SIGUSR1 to the job steps' processes (not to this shell) {SIGNAL_LEAD_S} s before the",
        "# time limit: torchrun's agent forwards it and the workers stop at the next step",
        "# boundary, save a checkpoint and exit 75, which this script answers with a requeue.",
        "# USR1, not TERM: Slurm ends a job (scancel, preemption) with TERM to all of it, srun",
        "# included, which answers by SIGKILLing the tasks; USR1 is a warning the tasks get alone.",
        f"--signal=USR1@{SIGNAL_LEAD_S}",
    ]
    return "\n".join(d if d.startswith("#") else f"#SBATCH {d}" for d in directives)


# ---------------------------------------------------------------------------- Kubernetes


def pytorchjob(job: ClusterJob) -> dict[str, Any]:
    """A Kubeflow training-operator PyTorchJob (kubeflow.org/v1).

    What the operator reads and sets (checked in kubeflow/training-operator v1.9.0):
    replica types "Master" (replicas must be 1) and "Worker" (>= 1) under
    spec.pytorchReplicaSpecs (webhooks/pytorch/pytorchjob_webhook.go); it injects its
    environment into every container and takes the port named "pytorchjob-port" of the
    container named "pytorch" (required) as MASTER_PORT, with MASTER_ADDR the master pod's
    service "<name>-master-0" (controller.v1/pytorch/envvar.go, master.go). Kubernetes
    expands $(MASTER_ADDR) in `command` from that environment, so every pod meets at the
    master with the same command; the operator's RANK, WORLD_SIZE and PET_* variables are
    for plain torchrun and are overridden by the explicit arguments.
    """
    check_k8s(job)
    command = _node_command(job, "python", "$(MASTER_ADDR):$(MASTER_PORT)", job.job_name)
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    # NCCL's shared-memory transport between a node's GPUs lives in /dev/shm, 64 MiB in a
    # container unless a memory-backed volume replaces it.
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    container: dict[str, Any] = {
        "name": "pytorch",
        "image": job.image,
        "command": command,
        "env": [{"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(SHUTDOWN_TIMEOUT_S)}],
        "ports": [{"name": "pytorchjob-port", "containerPort": K8S_PORT}],
    }
    if job.pvc:
        # run.dir and data.dir (relative by default) land on the claim: checkpoints survive a
        # pod and every pod sees the same ones.
        mounts.append({"name": "run", "mountPath": K8S_WORKDIR})
        volumes.append({"name": "run", "persistentVolumeClaim": {"claimName": job.pvc}})
        container["workingDir"] = K8S_WORKDIR
    if job.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": job.gpus_per_node}}
    container["volumeMounts"] = mounts
    # SIGTERM (a drained node, a deleted pod) reaches the launcher, PID 1; the kubelet's
    # SIGKILL follows after this grace period, so it covers the agent's wait for the save.
    template = {"spec": {"terminationGracePeriodSeconds": SIGNAL_LEAD_S, "containers": [container], "volumes": volumes}}

    def replica(n: int) -> dict[str, Any]:
        # OnFailure: a pod that exits 75 (preempted, saved) or crashes restarts and resumes.
        return {"replicas": n, "restartPolicy": "OnFailure", "template": copy.deepcopy(template)}

    specs = {"Master": replica(1)}
    if job.nnodes > 1:
        specs["Worker"] = replica(job.nnodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job.job_name},
        "spec": {
            "nprocPerNode": str(job.nproc),
            "runPolicy": {"backoffLimit": K8S_BACKOFF_LIMIT},
            "pytorchReplicaSpecs": specs,
        },
    }


def pytorchjob_yaml(job: ClusterJob) -> str:
    manifest = pytorchjob(job)
    workers = job.nnodes - 1
    return (
        f"# Written by `scaletrain launch --k8s`: a Master pod and {workers} Worker pod(s) x {job.nproc} process(es).\n"
        "# Needs the Kubeflow training operator. Submit with: kubectl create -f THIS_FILE. See docs/clusters.md.\n"
        + yaml.safe_dump(manifest, sort_keys=False)
    )


# ---------------------------------------------------------------------------- files


def write_atomically(path: str, text: str, executable: bool = False) -> Path:
    """Whole or not at all: a reader (sbatch, kubectl) never sees half a file."""
    out = Path(path)
    if not out.parent.is_dir():
        raise UserError(f"{path!r}: directory {str(out.parent)!r} not found; accepted: a file in an existing directory")
    if out.is_dir():
        raise UserError(f"{path!r} is a directory; accepted: a file name")
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o755 if executable else 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def submit(argv: list[str]) -> str:
    """Run `sbatch FILE` or `kubectl create -f FILE`; its output, or a one-line UserError."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        raise UserError(
            f"--submit: {argv[0]} not found on PATH; the file is written, submit it where {argv[0]} is: {shlex.join(argv)}"
        ) from None
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise UserError(f"--submit: {shlex.join(argv)} failed (exit {proc.returncode}): {last}")
    return proc.stdout.strip()
