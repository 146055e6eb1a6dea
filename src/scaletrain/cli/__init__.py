"""Command line: the only module that reads argv. Bad input ends in one line and exit code 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scaletrain import __version__
from scaletrain.config import DataConfig
from scaletrain.errors import EXIT_PREEMPTED, Preempted, UserError

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scaletrain",
        description="Plan, run, watch and recover distributed training of language models.",
        epilog="Under torchrun: torchrun --nproc-per-node N -m scaletrain train [CONFIG.yaml ...] [key=value ...]",
    )
    p.add_argument("--version", action="version", version=f"scaletrain {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = sub.add_parser(
        "train",
        help="train a model (embedded default when no config is given)",
        description="Train. YAML files are merged in order, then dotted overrides such as train.lr=3e-4 apply.",
    )
    t.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    t.set_defaults(func=_cmd_train)

    pl = sub.add_parser(
        "plan",
        help="estimate memory, communication and time for every strategy, and pick one",
        description="Estimate per-device memory (params, grads, optimizer, activations, loss, buffers), "
        "communication and step time for every strategy the world allows; choose the fastest that fits.",
    )
    pl.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    pl.add_argument("--gpus-per-node", type=int, default=8)
    pl.add_argument("--nodes", type=int, default=1)
    pl.add_argument("--gpu", help="h100 (default), h100-pcie, h200, a100, a100-40gb, l40s, or cpu (this machine)")
    pl.add_argument("--gpu-memory", help="memory per device, e.g. 80GiB (default: the GPU's)")
    pl.add_argument("--cpu-memory", help="host memory per node, e.g. 1TiB (checks offload)")
    pl.add_argument("--headroom", type=float, default=0.1, help="share of device memory kept free (default 0.1)")
    pl.add_argument("--configured-only", action="store_true", help="only the strategy in the config, not all of them")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument("--emit-deepspeed", metavar="PATH", help="write the chosen plan as DeepSpeed JSON for HF Trainer")
    pl.add_argument("--measure", action="store_true", help="run 3 real steps and compare measured with predicted peaks")
    pl.set_defaults(func=_cmd_plan)

    la = sub.add_parser(
        "launch",
        help="launch `train` on N processes per node via torchrun or the deepspeed launcher",
        description="Launch `scaletrain train` under torchrun (default) or DeepSpeed's launcher. "
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
    la.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    la.set_defaults(func=_cmd_launch)

    d = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = d.add_parser(
        "prepare",
        help="tokenize .txt/.jsonl/.parquet files into token shards + manifest",
        description="Tokenize files into numpy token shards with a manifest (tokenizer, counts, checksums).",
    )
    prep.add_argument("--input", nargs="+", required=True, metavar="GLOB", help="files or globs (.txt, .jsonl, .parquet)")
    prep.add_argument("--out", required=True, metavar="DIR", help="output directory (must not hold a dataset yet)")
    defaults = DataConfig()
    prep.add_argument("--vocab-size", type=int, default=defaults.vocab_size, help="BPE vocabulary size when training a tokenizer")
    prep.add_argument(
        "--tokenizer",
        metavar="TOKENIZER",
        help="use this tokenizer.json (or a model directory holding one) instead of training one",
    )
    prep.add_argument("--text-field", default="text", help="field holding the text in .jsonl/.parquet records")
    prep.add_argument("--shard-tokens", type=int, default=defaults.shard_tokens, help="tokens per shard file")
    prep.set_defaults(func=_cmd_data_prepare)

    from scaletrain.cli.ckpt import add_parser as add_ckpt_parser

    add_ckpt_parser(sub)
    from scaletrain.cli.diagnose import add_compare_parser, add_diagnose_parser

    add_diagnose_parser(sub)
    add_compare_parser(sub)
    from scaletrain.cli.bench import add_parser as add_bench_parser

    add_bench_parser(sub)
    return p


def _cmd_train(args: argparse.Namespace) -> int:
    from scaletrain.config import load_config, split_args

    cfg = load_config(*split_args(args.args))
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from scaletrain.trainer import train

    train(cfg)
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from scaletrain.cli.plan import run_plan
    from scaletrain.config import load_config, split_args

    if not 0 <= args.headroom < 1:
        raise UserError(f"--headroom {args.headroom} is invalid; accepted: a fraction in [0, 1)")
    return run_plan(load_config(*split_args(args.args)), args)


def _cmd_launch(args: argparse.Namespace) -> int:
    from scaletrain.cli.cluster import check_cluster_args, cmd_cluster
    from scaletrain.config import load_config, split_args
    from scaletrain.data import resolve_dataset_dir
    from scaletrain.launch import LaunchOptions, exec_launcher, launch_command, run_torchrun
    from scaletrain.parallel import dims_for

    check_cluster_args(args)
    # One clear error here, not one per rank after N processes have started.
    cfg = load_config(*split_args(args.args))
    if not args.k8s:  # a pod's data is in its image or volume, not necessarily here
        resolve_dataset_dir(cfg.data)
    if args.hostfile is None and args.nproc >= 1 and args.nnodes >= 1:
        dims_for(cfg.parallel, args.nproc * args.nnodes)  # the layout fits the world it will get
    if args.slurm or args.k8s:
        return cmd_cluster(args)
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
            train_args=tuple(args.args),
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=args.rdzv_id or "scaletrain",
        )
    )
    if args.dry_run:
        import shlex

        print(shlex.join(cmd))
        return 0
    if args.launcher == "torchrun":
        return run_torchrun(cmd)
    exec_launcher(cmd)
    return 0  # not reached: exec replaced this process


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from scaletrain.data import prepare_dataset

    out = prepare_dataset(
        args.input,
        Path(args.out),
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        shard_tokens=args.shard_tokens,
    )
    print(f"prepared dataset: {out} (see {out / 'manifest.json'})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The `scaletrain` command. Called without argv it is the process: it then ends it."""
    code = _main(sys.argv[1:] if argv is None else argv)
    if argv is None and sys.getprofile() is None and sys.gettrace() is None:  # no profiler or debugger wraps us
        _end_process(code)
    return code


def _end_process(code: int) -> None:
    """Exit without the interpreter's teardown of torch's modules: 0.6 s or more of one core
    per process after the work is done, paid by every rank, the agent and each CLI call.
    Before that, what a normal exit does first, in its order: threading's own shutdown (the
    callbacks registered with it, such as concurrent.futures telling its pool workers to
    stop, then a join of every thread that is not a daemon), the atexit handlers (logging,
    W&B, multiprocessing, torch's), the streams flushed. A bare join of the threads hung
    forever where a ThreadPoolExecutor existed (torch.compile's): its workers leave only
    once that callback has run."""
    import atexit
    import os
    import threading

    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str]) -> int:
    # The deepspeed launcher appends --local_rank=N to each rank's arguments; the same
    # value is in the LOCAL_RANK environment variable, which is what we read.
    argv = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        from scaletrain.launch import launcher_rank, report_error

        # The launcher itself is no rank, whatever RANK a cluster put in its environment
        # (the Kubeflow operator sets RANK per pod): it always says what stopped it.
        report_error(str(e), 0 if args.command == "launch" else launcher_rank())
        return EXIT_USAGE
    except Preempted as e:
        from scaletrain.launch import launcher_rank, report_preempted

        report_preempted(str(e), launcher_rank())
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("scaletrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
