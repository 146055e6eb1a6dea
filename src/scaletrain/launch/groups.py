"""`scaletrain launch --ft-groups N --nproc K`: N replica groups of K ranks on this machine.

A torchft lighthouse (the quorum's server) runs in this process on loopback, beside a
small key-value store the groups check in at so that their first quorum waits for all of
them (resilience/replica_groups.py); then each group is a `scaletrain launch --nproc K` of its own:
its own torchrun agent and rendezvous, restarted by that agent when one of its ranks
fails (--max-restarts, default 3 here), while the other groups' processes go on.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

from scaletrain.errors import UserError
from scaletrain.launch.env import GROUP_ENV, LIGHTHOUSE_ENV, START_ENV

DEFAULT_RESTARTS = 3  # per group: a group that keeps failing stops after these and the others go on
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def group_command(nproc: int, max_restarts: int, words: list[str], groups: int) -> list[str]:
    return [
        sys.executable, "-m", "scaletrain", "launch", f"--nproc={nproc}", f"--max-restarts={max_restarts or DEFAULT_RESTARTS}",
        *words, f"fault_tolerance.groups={groups}",
    ]  # fmt: skip


def require_torchft() -> None:
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise UserError(
            "replica groups (fault_tolerance.groups > 1, --ft-groups) need torchft; accepted: pip install 'scaletrain[ft]'"
        ) from None


def run_groups(groups: int, min_groups: int, heartbeat_timeout_s: float, command: list[str]) -> int:
    """Start the lighthouse and the groups, forward stop signals to them, wait for all;
    the exit code is 0 when every group ended well, else the first group's failure."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum and commit at info
    require_torchft()
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_groups, heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, **{LIGHTHOUSE_ENV: lighthouse.address(), START_ENV: f"localhost:{store.port}"})
    print(f"scaletrain launch: {groups} replica groups, lighthouse {lighthouse.address()}", file=sys.stderr, flush=True)
    procs = [subprocess.Popen(command, env=env | {GROUP_ENV: str(g)}) for g in range(groups)]
    previous = {s: signal.signal(s, _forward(procs)) for s in FORWARDED}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        lighthouse.shutdown()
    failed = [(g, c) for g, c in enumerate(codes) if c]
    for g, code in failed:
        print(f"scaletrain launch: replica group {g} ended with exit code {code}; its output is above", file=sys.stderr)
    return failed[0][1] if failed else 0


def _forward(procs: list[subprocess.Popen[Any]]) -> Any:
    def handler(signum: int, frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    return handler


def serve(min_groups: int, heartbeat_timeout_s: float, port: int, store_port: int) -> None:
    """On a cluster (launch/cluster_groups.py): the lighthouse on `port` and the start barrier's
    store on `store_port`, until this process is stopped."""
    os.environ.setdefault("RUST_LOG", "warn")
    require_torchft()
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind=f"[::]:{port}", min_replicas=min_groups, heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000)
    )
    store = TCPStore("0.0.0.0", store_port, is_master=True, wait_for_workers=False)
    print(f"scaletrain: lighthouse {lighthouse.address()}, start barrier on port {store.port}", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        lighthouse.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a torchft lighthouse and the replica groups' start barrier")
    parser.add_argument("--min-groups", type=int, required=True)
    parser.add_argument("--heartbeat-timeout-s", type=float, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    a = parser.parse_args()
    serve(a.min_groups, a.heartbeat_timeout_s, a.port, a.store_port)
