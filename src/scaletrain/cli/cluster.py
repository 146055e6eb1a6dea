"""`scaletrain launch --slurm OUT / --k8s OUT`: which options go together, and writing the file."""

from __future__ import annotations

import argparse
import os
import shlex

from scaletrain.errors import UserError
from scaletrain.launch.cluster import ClusterJob, pytorchjob_yaml, sbatch_script, submit, write_atomically

CLUSTER_ONLY = ("submit", "job_name", "gpus_per_node", "partition", "account", "time", "image", "pvc")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_cluster_args(args: argparse.Namespace) -> None:
    """Before the config is read: a wrong combination costs nothing to report."""
    if args.slurm and args.k8s:
        raise UserError("--slurm and --k8s do not go together; accepted: one of them, each writes its own file")
    if not (args.slurm or args.k8s):
        given = [_flag(d) for d in CLUSTER_ONLY if getattr(args, d) not in (None, False)]
        if given:
            raise UserError(f"{', '.join(given)}: only with --slurm OUT.sbatch or --k8s OUT.yaml")
        return
    kind = "--slurm" if args.slurm else "--k8s"
    # Each node of the job finds the others through the rendezvous the file sets up.
    clashing = [
        _flag(d) for d in ("hostfile", "node_rank", "master_addr", "rdzv_endpoint", "rdzv_id") if getattr(args, d) is not None
    ]
    if args.launcher == "deepspeed":
        clashing.append("--launcher deepspeed")
    if clashing:
        raise UserError(
            f"{kind} does not go with {', '.join(clashing)}; accepted: --nproc, --nnodes, --max-restarts and the "
            "cluster options: every node gets the same command and the nodes meet through torchrun's rendezvous"
        )
    if args.submit and args.dry_run:
        raise UserError("--submit does not go with --dry-run; accepted: one of them")


def write_cluster_file(args: argparse.Namespace, groups: tuple[int, int, float] | None = None) -> int:
    """The --slurm script or --k8s manifest; with `groups` (replica groups, min_groups, the
    lighthouse's heartbeat timeout), a lighthouse and one job per group (launch/cluster_groups.py)."""
    job = ClusterJob(
        nproc=args.nproc,
        nnodes=args.nnodes,
        train_args=tuple(args.args),
        job_name=args.job_name or "scaletrain",
        max_restarts=args.max_restarts,
        port=args.master_port,
        partition=args.partition,
        account=args.account,
        time=args.time,
        gpus_per_node=args.gpus_per_node,
        image=args.image,
        pvc=args.pvc,
        workdir=os.getcwd(),
    )
    if groups is not None:
        from scaletrain.launch.cluster_groups import group_manifests_yaml, sbatch_groups_script

        out, text = (
            (args.slurm, sbatch_groups_script(job, *groups)) if args.slurm else (args.k8s, group_manifests_yaml(job, *groups))
        )
        submit_cmd = ["sbatch", out] if args.slurm else ["kubectl", "create", "-f", out]
        what = f"{groups[0]} replica groups of {job.nnodes} node(s) x {job.nproc} process(es) and a torchft lighthouse"
    elif args.slurm:
        out, text = args.slurm, sbatch_script(job)
        submit_cmd = ["sbatch", out]
        what = f"sbatch script: {job.nnodes} node(s) x {job.nproc} process(es), requeued when preempted"
    else:
        out, text = args.k8s, pytorchjob_yaml(job)
        submit_cmd = ["kubectl", "create", "-f", out]
        what = f"PyTorchJob {job.job_name!r}: 1 Master + {job.nnodes - 1} Worker pod(s) x {job.nproc} process(es)"
    if args.dry_run:
        print(text, end="")
        return 0
    write_atomically(out, text, executable=bool(args.slurm))
    print(f"scaletrain launch: wrote {out} ({what})")
    if args.submit:
        print(submit(submit_cmd))
    else:
        print(f"submit with: {shlex.join(submit_cmd)}")
    return 0
