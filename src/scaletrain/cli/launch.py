"""`scaletrain launch`: `train` on N processes per node under torchrun's agent (in this
process) or DeepSpeed's launcher; with --slurm / --k8s, the cluster's job file instead
(launch/cluster.py)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from scaletrain.cli.cluster import check_cluster_args, write_cluster_file
from scaletrain.cli.rank import forked_ranks
from scaletrain.config import load_config, split_args
from scaletrain.config.parallel import dims_for
from scaletrain.errors import UserError
from scaletrain.launch.env import GROUP_ENV
from scaletrain.launch.groups import group_command, run_groups
from scaletrain.launch.torchrun import LaunchOptions, exec_launcher, launch_command, run_torchrun
from scaletrain.training.paths import make_dir


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    la = sub.add_parser(
        name,
        help="launch `train` (or `eval RUN`) on N processes per node via torchrun or the deepspeed launcher",
        description="Launch `scaletrain train` under torchrun (default) or DeepSpeed's launcher; `eval RUN_OR_CHECKPOINT "
        "[key=value ...]` as the first words launches `scaletrain eval` instead. "
        "Multi-node: run the same command on every node with its --node-rank, or give a --hostfile.",
    )
    la.add_argument("--nproc", type=int, required=True, help="processes (GPUs) per node")
    la.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    la.add_argument("--node-rank", type=int, help="this node's rank, 0..nnodes-1")
    la.add_argument("--master-addr", help="address of node 0")
    la.add_argument("--master-port", type=int, help="port on node 0 (default 29500)")
    la.add_argument("--hostfile", help="'hostname slots=N' per line (DeepSpeed/MPI format)")
    la.add_argument("--launcher", choices=["torchrun", "deepspeed"], default="torchrun")
    la.add_argument(
        "--max-restarts", type=int, default=0, help="restart all workers after a failure up to N times; each resumes by itself"
    )
    la.add_argument(
        "--ft-groups", type=int, metavar="N", help="N replica groups of --nproc ranks that outlive a failed one (torchft; "
        "a lighthouse on this machine; docs/fault-tolerance.md)",
    )  # fmt: skip
    la.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="torchrun's c10d rendezvous: the same command on every node")
    la.add_argument("--rdzv-id", help="rendezvous id, the same on every node (default scaletrain)")
    la.add_argument("--dry-run", action="store_true", help="print the launcher command (or the --slurm/--k8s file) and exit")
    cl = la.add_argument_group("clusters (docs/clusters.md)")
    cl.add_argument("--slurm", metavar="OUT.sbatch", help="write an sbatch script for --nnodes nodes instead of launching")
    cl.add_argument("--k8s", metavar="OUT.yaml", help="write a Kubeflow PyTorchJob manifest instead of launching")
    cl.add_argument("--submit", action="store_true", help="then submit it (sbatch, or kubectl create -f)")
    cl.add_argument("--job-name", help="job name (default scaletrain)")
    cl.add_argument("--gpus-per-node", type=int, help="GPUs to request per node (default: none)")
    cl.add_argument("--partition", help="Slurm partition")
    cl.add_argument("--account", help="Slurm account")
    cl.add_argument("--time", help="Slurm time limit, e.g. 24:00:00")
    cl.add_argument("--image", help="--k8s: container image with scaletrain installed (required)")
    cl.add_argument("--pvc", help="--k8s: PersistentVolumeClaim mounted as the working directory (run.dir, data.dir)")
    la.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value | eval RUN key=value")
    return la


def run(args: argparse.Namespace) -> int:
    check_cluster_args(args)
    command, words = ("eval", args.args[1:]) if args.args[:1] == ["eval"] else ("train", args.args)
    # One clear error here, not one per rank after N processes have started.
    if command == "eval":
        _eval_args(words)
    else:
        _train_args(
            args, [*words, *([f"fault_tolerance.groups={args.ft_groups}"] if args.ft_groups and args.ft_groups > 1 else [])]
        )
    if args.ft_groups is not None:
        return _replica_groups(args, words)
    if args.slurm or args.k8s:
        return write_cluster_file(args)
    cmd = launch_command(
        LaunchOptions(
            nproc=args.nproc,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            hostfile=args.hostfile,
            launcher=args.launcher,
            max_restarts=args.max_restarts,
            train_args=tuple(words),
            command=command,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=args.rdzv_id or "scaletrain",
        )
    )
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    if args.launcher == "torchrun":
        return run_torchrun(cmd, forked_ranks(command, words))
    exec_launcher(cmd)
    return 0  # not reached: exec replaced this process


def _replica_groups(args: argparse.Namespace, words: list[str]) -> int:
    n = args.ft_groups
    cluster = bool(args.slurm or args.k8s)  # --nnodes: nodes per group there
    others = [
        flag
        for flag, given in (
            ("--nnodes", args.nnodes != 1 and not cluster), ("--hostfile", args.hostfile),
            ("--rdzv-endpoint", args.rdzv_endpoint), ("--launcher deepspeed", args.launcher != "torchrun"),
            ("eval", args.args[:1] == ["eval"]),
        )
        if given
    ]  # fmt: skip
    if n < 2 or others:
        raise UserError(
            f"--ft-groups {n}{' with ' + ', '.join(others) if others else ''} is not supported; accepted: --ft-groups N >= 2 "
            "with --nproc K for `train`: on this machine, or with --slurm / --k8s and --nnodes per group"
        )
    cfg = load_config(*split_args([*words, f"fault_tolerance.groups={n}"]))
    ft = cfg.fault_tolerance
    if cluster:
        return write_cluster_file(args, (n, ft.min_groups, ft.heartbeat_timeout_s))
    command = group_command(args.nproc, args.max_restarts, words, n)
    if args.dry_run:
        print(shlex.join(command) + f"  # x {n}, {GROUP_ENV}=0..{n - 1}")
        return 0
    return run_groups(n, ft.min_groups, ft.heartbeat_timeout_s, command)


def _train_args(args: argparse.Namespace, words: list[str]) -> None:
    cfg = load_config(*split_args(words))
    if not args.k8s:  # a pod's data and run directory are in its image or volume, not necessarily here
        from scaletrain.data import mix_to_prepare, resolve_dataset_dir  # numpy: only when the data is looked for

        mix_to_prepare(cfg.data) if cfg.data.mix else resolve_dataset_dir(cfg.data)  # judges every source's paths
        make_dir(cfg.run.dir, "run.dir", create=False)  # each rank makes it; refused here if it cannot be
    if args.hostfile is None and args.nproc >= 1 and args.nnodes >= 1:
        dims_for(cfg.parallel, args.nproc * args.nnodes)  # the layout fits the world it will get


def _eval_args(words: list[str]) -> None:
    """`launch ... eval RUN_OR_CHECKPOINT key=value ...`: the words checked (the ranks read the
    checkpoint's config themselves)."""
    if not words or "=" in words[0]:
        raise UserError("launch ... eval needs RUN_OR_CHECKPOINT first: a run directory or a checkpoints/step_<N> directory")
    if not Path(words[0]).exists():
        raise UserError(f"launch ... eval {words[0]}: no such run or checkpoint directory")
    files, _ = split_args(words[1:])
    if files:
        raise UserError(f"scaletrain eval takes key=value overrides of the checkpoint's own config, not {files[0]}")
