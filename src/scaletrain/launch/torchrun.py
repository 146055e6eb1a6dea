"""`scaletrain launch`: one command line that becomes the right torchrun / deepspeed invocation.

The launcher itself stays the real one (torchrun's elastic agent or DeepSpeed's runner);
this module only builds its argument list from our options, checks the config once
before N processes would each report the same mistake, and then hands over.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import EXIT_HUNG, EXIT_OOM, EXIT_PREEMPTED, EXIT_USAGE, UserError
from scaletrain.launch import forked, startup
from scaletrain.launch.env import ERROR_DIR_ENV, RELAUNCH_ENV

# torchrun's default set plus SIGUSR1, the other signal the workers stop on (resilience/preempt.py).
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@dataclass
class LaunchOptions:
    nproc: int
    nnodes: int = 1
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    hostfile: str | None = None
    launcher: str = "torchrun"
    max_restarts: int = 0
    train_args: tuple[str, ...] = ()  # the command's words
    command: str = "train"  # the scaletrain command each rank runs: train, or eval (of a checkpoint)
    # torchrun's c10d rendezvous: every node runs the same command and the agents meet at
    # HOST:PORT (the store runs on whichever node HOST is), so no node needs a rank of its
    # own; what a Slurm script or a Kubernetes pod can give every node alike (launch/cluster.py).
    rdzv_endpoint: str | None = None
    rdzv_id: str = "scaletrain"


@dataclass(frozen=True)
class Host:
    name: str
    slots: int | None


def read_hostfile(path: str) -> list[Host]:
    """DeepSpeed/MPI style: one `hostname [slots=N]` per line, # comments allowed."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--hostfile {path!r} not found; accepted: a file with one 'hostname slots=N' per line")
    hosts = []
    for n, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *rest = line.split()
        slots = None
        for item in rest:
            key, _, value = item.partition("=")
            if key != "slots" or not value.isdigit() or int(value) < 1:
                raise UserError(f"--hostfile {path}:{n}: {item!r} not understood; accepted: 'hostname slots=N' with N >= 1")
            slots = int(value)
        hosts.append(Host(name, slots))
    if not hosts:
        raise UserError(f"--hostfile {path!r} lists no host; accepted: one 'hostname slots=N' per line")
    return hosts


def launch_command(opts: LaunchOptions) -> list[str]:
    if opts.launcher == "deepspeed":
        _check_numbers(opts)
        return _deepspeed_command(opts)
    if opts.hostfile and opts.rdzv_endpoint is None:
        opts = _from_hostfile(opts)
    _check_numbers(opts)
    # SIGUSR1 too: Slurm's warning before the time limit (`--signal=USR1@...`, launch/cluster.py)
    # reaches the agent as well as the workers, and an agent without a handler would die of
    # it (the default action) instead of waiting for the workers' save.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={opts.nproc}",
        f"--signals-to-handle={AGENT_SIGNALS}",
    ]
    if opts.max_restarts:
        # A failed worker restarts the whole group, which resumes from the newest whole
        # checkpoint by itself (train.resume=auto).
        cmd.append(f"--max-restarts={opts.max_restarts}")
    if opts.rdzv_endpoint is not None:
        cmd += [
            f"--nnodes={opts.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={opts.rdzv_endpoint}",
            f"--rdzv-id={opts.rdzv_id}",
        ]
    elif opts.nnodes == 1 and opts.master_addr is None:
        cmd.append("--standalone")  # a private rendezvous on a free local port
    else:
        if opts.node_rank is None or opts.master_addr is None:
            raise UserError(
                f"--nnodes {opts.nnodes} needs --node-rank (0..{opts.nnodes - 1}) and --master-addr on each node "
                "(or --hostfile listing the nodes, or --rdzv-endpoint HOST:PORT on every node)"
            )
        cmd += [
            f"--nnodes={opts.nnodes}",
            f"--node-rank={opts.node_rank}",
            f"--master-addr={opts.master_addr}",
            f"--master-port={opts.master_port or 29500}",
        ]
    return cmd + ["-m", "scaletrain", opts.command, *opts.train_args]


def parse_endpoint(value: str) -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 host in brackets) -> (host, port); anything else is a UserError."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or any(c.isspace() for c in host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--rdzv-endpoint {value!r} is invalid; accepted: HOST:PORT with PORT in 1..65535")
    return host, int(port)


def _check_rendezvous(opts: LaunchOptions) -> None:
    parse_endpoint(opts.rdzv_endpoint or "")
    given = [
        name
        for name, value in (
            ("--node-rank", opts.node_rank),
            ("--master-addr", opts.master_addr),
            ("--master-port", opts.master_port),
            ("--hostfile", opts.hostfile),
        )
        if value is not None
    ]
    if given:
        raise UserError(
            f"--rdzv-endpoint does not go with {', '.join(given)}; accepted: the same command on every node, "
            "the agents meet at the endpoint and number the nodes themselves"
        )
    if opts.launcher == "deepspeed":
        raise UserError("--rdzv-endpoint needs --launcher torchrun (DeepSpeed's launcher has no rendezvous)")
    if not opts.rdzv_id or any(c.isspace() for c in opts.rdzv_id):
        raise UserError(f"--rdzv-id {opts.rdzv_id!r} is invalid; accepted: a non-empty id without spaces, the same on every node")


def _deepspeed_command(opts: LaunchOptions) -> list[str]:
    ds = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if opts.hostfile:
        read_hostfile(opts.hostfile)  # validate here: DeepSpeed's own message is a traceback
        ds += ["--hostfile", opts.hostfile]
    else:
        ds += ["--num_gpus", str(opts.nproc), "--num_nodes", str(opts.nnodes)]
        if opts.nnodes > 1:
            if opts.node_rank is None or opts.master_addr is None:
                raise UserError(
                    "--launcher deepspeed with --nnodes > 1 needs --hostfile, or --node-rank and --master-addr (runs with --no_ssh)"
                )
            ds += ["--no_ssh", "--node_rank", str(opts.node_rank)]
    if opts.master_addr:
        ds += ["--master_addr", opts.master_addr]
    if opts.master_port:
        ds += ["--master_port", str(opts.master_port)]
    return ds + ["--module", "scaletrain", opts.command, *opts.train_args]


def _from_hostfile(opts: LaunchOptions) -> LaunchOptions:
    """torchrun has no ssh fan-out: the hostfile gives the node count, master and node rank."""
    hosts = read_hostfile(opts.hostfile or "")
    node_rank = opts.node_rank
    if node_rank is None:
        me = (
            {socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1"}
            if len(hosts) == 1
            else {socket.gethostname(), socket.getfqdn()}
        )
        matches = [i for i, h in enumerate(hosts) if h.name in me]
        if len(matches) != 1:
            raise UserError(
                f"cannot tell which --hostfile entry is this machine ({socket.gethostname()}); pass --node-rank, "
                "and run the same command on every listed node (torchrun does not ssh to them)"
            )
        node_rank = matches[0]
    slots = {h.slots for h in hosts if h.slots}
    if len(slots) > 1:
        raise UserError(
            "--launcher torchrun needs the same slots=N on every --hostfile line; use --launcher deepspeed for uneven nodes"
        )
    return LaunchOptions(
        nproc=slots.pop() if slots else opts.nproc,
        nnodes=len(hosts),
        node_rank=node_rank,
        master_addr=opts.master_addr or hosts[0].name,
        master_port=opts.master_port,
        launcher=opts.launcher,
        max_restarts=opts.max_restarts,
        train_args=opts.train_args,
        command=opts.command,
    )


def _check_numbers(opts: LaunchOptions) -> None:
    if opts.rdzv_endpoint is not None:
        _check_rendezvous(opts)
    if opts.nproc < 1:
        raise UserError(f"--nproc {opts.nproc} is invalid; accepted: processes per node >= 1")
    if opts.nnodes < 1:
        raise UserError(f"--nnodes {opts.nnodes} is invalid; accepted: >= 1")
    if opts.node_rank is not None and not 0 <= opts.node_rank < opts.nnodes:
        raise UserError(f"--node-rank {opts.node_rank} is invalid with --nnodes {opts.nnodes}; accepted: 0..{opts.nnodes - 1}")
    if opts.max_restarts < 0:
        raise UserError(f"--max-restarts {opts.max_restarts} is invalid; accepted: an integer >= 0")
    if opts.max_restarts and opts.launcher == "deepspeed":
        raise UserError("--max-restarts needs --launcher torchrun (DeepSpeed's launcher does not restart workers)")
    if opts.master_port is not None and not 0 < opts.master_port < 65536:
        raise UserError(f"--master-port {opts.master_port} is invalid; accepted: 1..65535")


# Each relaunch runs at a smaller micro-batch; the bound only guards against a loop.
MAX_OOM_RELAUNCHES = 16
LINGER_S = 3.0  # how long the rendezvous host's agent outlives the others' shutdown


def run_torchrun(cmd: list[str], ranks: forked.ForkedRanks | None = None) -> int:
    """Run torchrun's elastic agent in this process; the exit code says how the ranks ended.

    In-process rather than exec'd, so that a bad input stays one line with exit code 2:
    torchrun itself folds every worker's exit code into 1 and adds a multi-line failure
    report of its own. Signals still reach the agent (it is this process), which forwards
    them to the workers as torchrun does. Where ranks are forked (launch/forked.py),
    `ranks` says how, and imports first what they need.
    """
    if cmd[1:3] != ["-m", "torch.distributed.run"]:
        raise ValueError(f"not a torchrun command: {cmd[:3]}")
    with startup.heavy_imports():  # torch: the agent lives as long as the run
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

        if ranks is not None and forked.start_method() == "fork":
            cmd = forked.fork_command(cmd, ranks.script)
            ranks.preload()
    # The agent's own log lines about failed workers (and, with forked ranks, those of
    # torch.multiprocessing stopping the others): replaced by the summary below.
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        agent_log = logging.getLogger(name)
        agent_log.addHandler(logging.NullHandler())
        agent_log.propagate = False  # torch's own handler sits on the "torch" logger above
    # torchrun shares its rendezvous TCPStore with the workers' process group by default,
    # and a restarted group then reads its peers' addresses from the failed attempt (gloo:
    # "connectFullMesh failed ... Connection refused"; pytorch/pytorch#135712). A store of
    # their own per attempt makes --max-restarts work.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # mkdtemp and a removal of our own, not a TemporaryDirectory: a forked rank would run
    # its finalizer at exit (atexit) and remove the directory the others still write to.
    errors = tempfile.mkdtemp(prefix="scaletrain-errors-")
    os.environ[ERROR_DIR_ENV] = errors
    sys.stdout.flush()  # a forked rank would print what is still buffered again
    sys.stderr.flush()
    try:
        _run_until_no_oom(lambda: run(parse_args(cmd[3:])))
        return 0
    except ChildFailedError as e:
        if _preempted(errors) and all(f.exitcode in (EXIT_PREEMPTED, -signal.SIGTERM) for f in e.failures.values()):
            return EXIT_PREEMPTED  # the workers were signalled directly and saved
        # A rank that met bad input wrote its line and exited 2; ranks the agent stopped
        # after that died of SIGTERM. Anything else crashed: its traceback is above.
        messages = sorted({p.read_text().strip() for p in Path(errors).glob("rank*")})
        for message in messages:
            print(f"scaletrain: error: {message}", file=sys.stderr)
        crashed = {r: f for r, f in e.failures.items() if f.exitcode not in (EXIT_USAGE, -signal.SIGTERM)}
        if messages and not crashed:
            return EXIT_USAGE
        codes = {f.exitcode for f in crashed.values()}
        if EXIT_HUNG in codes and codes <= {EXIT_HUNG, -signal.SIGKILL}:
            return EXIT_HUNG  # the watchdog's rank 0 printed which ranks and where (resilience/watchdog.py)
        for rank, failure in sorted((crashed or e.failures).items()):
            how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            print(f"scaletrain launch: rank {rank} (pid {failure.pid}) failed with {how}; its output is above", file=sys.stderr)
        return 1
    except SignalException as e:
        # The agent forwarded the signal and waited for the workers: on SIGTERM/SIGUSR1
        # they stopped at one step boundary and saved (resilience/preempt.py).
        if _preempted(errors):
            return EXIT_PREEMPTED
        print(f"scaletrain launch: stopped by {e.sigval.name}; the workers were stopped too", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        os.environ.pop(ERROR_DIR_ENV, None)
        shutil.rmtree(errors, ignore_errors=True)
        _linger_if_rendezvous_host(cmd)


def _run_until_no_oom(agent: Callable[[], None]) -> None:
    """Run the agent; after ranks ended on an out-of-memory error (each wrote what it will
    continue at, resilience/oom.py), run it again: every rank starts from the newest checkpoint at the
    smaller micro-batch. A micro-batch shrinks each time, so this ends."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for relaunch in range(1, MAX_OOM_RELAUNCHES + 1):
        try:
            agent()
            return
        except ChildFailedError as e:
            if not any(f.exitcode == EXIT_OOM for f in e.failures.values()) or relaunch == MAX_OOM_RELAUNCHES:
                raise
        print(
            f"scaletrain launch: out of memory (above); restarting every rank from the newest checkpoint at the smaller micro-batch (relaunch {relaunch})",
            file=sys.stderr,
            flush=True,
        )
        os.environ[RELAUNCH_ENV] = str(relaunch)


def _linger_if_rendezvous_host(cmd: list[str]) -> None:
    """With c10d rendezvous the agent on the endpoint's machine serves the store the other
    agents still talk to while they shut down; if it leaves first, an agent elsewhere can
    abort inside torch ("terminate called without an active exception", exit 134, seen
    once in CI after a preemption on two loopback nodes). So it leaves a moment later."""
    endpoint = next((a.split("=", 1)[1] for a in cmd if a.startswith("--rdzv-endpoint=")), None)
    if endpoint is None:
        return
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname  # private: torch's own test

    if _matches_machine_hostname(endpoint.rsplit(":", 1)[0]):
        time.sleep(LINGER_S)


def _preempted(errors: str) -> bool:
    """Print the workers' preemption line once; True if any worker wrote one."""
    lines = sorted({p.read_text().strip() for p in Path(errors).glob("preempted-rank*")})
    for line in lines:
        print(f"scaletrain: {line}", file=sys.stderr)
    return bool(lines)


def launcher_rank() -> int:
    """Rank from the environment, usable before any process group exists (error printing).
    Here, not in launch/distributed.py: a bad config must not wait for torch's import to be told."""
    return int(os.environ.get("RANK", "0"))


def report_preempted(message: str, rank: int) -> None:
    """A worker that stopped on a preemption signal, checkpoint saved (exit EXIT_PREEMPTED)."""
    directory = os.environ.get(ERROR_DIR_ENV)
    if directory and Path(directory).is_dir():
        (Path(directory) / f"preempted-rank{rank}").write_text(message)
    elif rank == 0:
        print(f"scaletrain: {message}", file=sys.stderr)


def report_error(message: str, rank: int) -> None:
    """Where a worker's UserError goes: the launcher's error directory, else stderr on rank 0."""
    directory = os.environ.get(ERROR_DIR_ENV)
    if directory and Path(directory).is_dir():
        (Path(directory) / f"rank{rank}").write_text(message)
    elif rank == 0:  # every rank usually hits the same error; say it once
        print(f"scaletrain: error: {message}", file=sys.stderr)


def exec_launcher(cmd: list[str]) -> None:
    """Replace this process with the launcher, so signals (Ctrl-C, SIGTERM) reach it directly."""
    print("scaletrain launch: " + shlex.join(cmd), file=sys.stderr, flush=True)
    env = dict(os.environ)
    if "deepspeed.launcher.runner" in cmd and not _has_cuda():
        env.setdefault("DS_ACCELERATOR", "cpu")
    os.execvpe(cmd[0], cmd, env)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
