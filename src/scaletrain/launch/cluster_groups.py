"""`scaletrain launch --ft-groups G --slurm / --k8s`: replica groups (fault_tolerance,
resilience/replica_groups.py) on a cluster: a torchft lighthouse plus one job per group.

The lighthouse runs as `python -m scaletrain.launch.groups`, beside the key-value store of
the groups' start barrier (each group's first quorum waits until every group is up, as
under `launch --ft-groups` on one machine).

Slurm: one allocation of G x --nnodes nodes. The batch shell starts the lighthouse on the
first node and one `srun` per group over that group's nodes (`--relative`), each a
`scaletrain launch` of its own with its own rendezvous, SCALETRAIN_FT_GROUP=g and the
lighthouse's address; every group is restarted by its own torchrun agent (--max-restarts)
while the others go on.

Kubernetes: a Deployment and a Service for the lighthouse, and one PyTorchJob per group
(cluster.pytorchjob: its pods restart on failure, and the group rejoins from a live one).
"""

from __future__ import annotations

import copy
import shlex
from dataclasses import replace
from typing import Any

import yaml

from scaletrain.launch.cluster import (
    ENVIRONMENT,
    REQUEUE,
    TERM_TRAP,
    ClusterJob,
    _node_command,
    check_slurm,
    processes,
    pytorchjob,
    sbatch_opening,
    sbatch_port,
)
from scaletrain.launch.env import GROUP_ENV, START_ENV

LIGHTHOUSE_PORT = 29510  # torchft_lighthouse's default
STORE_PORT = 29511  # the start barrier's (Kubernetes; Slurm derives both from the job id)
DEFAULT_RESTARTS = 3  # per group, as `launch --ft-groups` (launch/groups.py)


def _group_args(job: ClusterJob, groups: int, lighthouse: str) -> tuple[str, ...]:
    return (*job.train_args, f"fault_tolerance.groups={groups}", f"fault_tolerance.lighthouse={lighthouse}")


def lighthouse_command(
    python: str, min_groups: int, heartbeat_timeout_s: float, port: int | str, store_port: int | str
) -> list[str]:
    return [
        python, "-m", "scaletrain.launch.groups", "--min-groups", str(min_groups),
        "--heartbeat-timeout-s", f"{heartbeat_timeout_s:g}", "--port", str(port), "--store-port", str(store_port),
    ]  # fmt: skip


def sbatch_groups_script(job: ClusterJob, groups: int, min_groups: int, heartbeat_timeout_s: float) -> str:
    check_slurm(job)
    job = replace(job, max_restarts=job.max_restarts or DEFAULT_RESTARTS)
    k = job.nnodes
    lighthouse = " ".join(shlex.quote(a) for a in lighthouse_command(job.python, min_groups, heartbeat_timeout_s, "@P@", "@S@"))
    lighthouse = lighthouse.replace("@P@", '"$lighthouse_port"').replace("@S@", '"$((lighthouse_port + 1))"')
    group_job = replace(job, train_args=_group_args(job, groups, "@LIGHTHOUSE@"))
    words = {
        "@ENDPOINT@": '"${nodes[g * ' + str(k) + ']}:$((port + g))"',
        "@ID@": '"$SLURM_JOB_ID-$g"',
        "fault_tolerance.lighthouse=@LIGHTHOUSE@": '"fault_tolerance.lighthouse=http://${nodes[0]}:$lighthouse_port"',
    }
    group_cmd = " ".join(words.get(a, shlex.quote(a)) for a in _node_command(group_job, job.python, "@ENDPOINT@", "@ID@"))
    title = (
        f"`scaletrain launch --ft-groups {groups} --slurm`: {groups} replica groups of {k} node(s) x\n"
        f"# {processes(job)}, and a torchft lighthouse on the first node."
    )
    return f"""{sbatch_opening(job, groups * k, title, "docs/fault-tolerance.md")}
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
# Group g meets at its first node on port + g; the lighthouse listens on port + {groups}
# and the start barrier's store on the port after it.
port={sbatch_port(job)}
lighthouse_port=$((port + {groups}))
export {START_ENV}="${{nodes[0]}}:$((lighthouse_port + 1))"

{ENVIRONMENT}
export RUST_LOG=warn  # torchft's servers log every quorum and commit at info

{TERM_TRAP}

echo "scaletrain: job $SLURM_JOB_ID, start $((${{SLURM_RESTART_COUNT:-0}} + 1)), {groups} replica groups on $SLURM_JOB_NODELIST, lighthouse ${{nodes[0]}}:$lighthouse_port" >&2
# The lighthouse forms each step's quorum of the live groups; it runs as long as they do.
{lighthouse} &
lighthouse=$!
pids=()
for ((g = 0; g < {groups}; g++)); do
    # The group's nodes (--relative), one task on each; a failed rank restarts its own
    # group only. --kill-on-bad-exit=0 as in the plain script: 75 after a preemption save.
    {GROUP_ENV}=$g srun --nodes={k} --ntasks={k} --ntasks-per-node=1 --relative=$((g * {k})) --cpus-per-task="$SLURM_CPUS_ON_NODE" \\
        --kill-on-bad-exit=0 {group_cmd} &
    pids+=("$!")
done
status=0
for pid in "${{pids[@]}}"; do
    while true; do
        code=0
        wait "$pid" || code=$?
        # Slurm's TERM (trapped above) interrupts `wait` while the group still runs: wait on.
        if ((code > 128)) && kill -0 "$pid" 2>/dev/null; then continue; fi
        break
    done
    if ((code > status)); then status=$code; fi
done
kill "$lighthouse" 2>/dev/null || true

{REQUEUE}"""


def group_manifests(job: ClusterJob, groups: int, min_groups: int, heartbeat_timeout_s: float) -> list[dict[str, Any]]:
    """The lighthouse's Deployment and Service, then one PyTorchJob per group."""
    job = replace(job, max_restarts=job.max_restarts or DEFAULT_RESTARTS)
    name = f"{job.job_name}-lighthouse"
    labels = {"app": name}
    address = f"http://{name}:{LIGHTHOUSE_PORT}"
    lighthouse = {
        "name": "lighthouse",
        "image": job.image,
        "command": lighthouse_command("python", min_groups, heartbeat_timeout_s, LIGHTHOUSE_PORT, STORE_PORT),
        "env": [{"name": "RUST_LOG", "value": "warn"}],
        "ports": [{"containerPort": LIGHTHOUSE_PORT}, {"containerPort": STORE_PORT}],
    }
    ports = [{"name": n, "port": p, "targetPort": p} for n, p in (("lighthouse", LIGHTHOUSE_PORT), ("start", STORE_PORT))]
    template = {"metadata": {"labels": labels}, "spec": {"containers": [lighthouse]}}
    manifests: list[dict[str, Any]] = [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": template},
        },
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": {"selector": labels, "ports": ports}},
    ]
    for g in range(groups):
        group = pytorchjob(replace(job, job_name=f"{job.job_name}-g{g}", train_args=_group_args(job, groups, address)))
        for spec in group["spec"]["pytorchReplicaSpecs"].values():
            container = spec["template"]["spec"]["containers"][0]
            container["env"] = copy.deepcopy(container["env"]) + [
                {"name": GROUP_ENV, "value": str(g)},
                {"name": START_ENV, "value": f"{name}:{STORE_PORT}"},
            ]
        manifests.append(group)
    return manifests


def group_manifests_yaml(job: ClusterJob, groups: int, min_groups: int, heartbeat_timeout_s: float) -> str:
    docs = group_manifests(job, groups, min_groups, heartbeat_timeout_s)
    return (
        f"# Written by `scaletrain launch --ft-groups {groups} --k8s`: a torchft lighthouse (Deployment + Service) and\n"
        f"# {groups} PyTorchJobs, one per replica group, of {job.nnodes} pod(s) x {job.nproc} process(es).\n"
        "# Needs the Kubeflow training operator. Submit with: kubectl create -f THIS_FILE. See docs/fault-tolerance.md.\n"
        + yaml.safe_dump_all(docs, sort_keys=False)
    )
