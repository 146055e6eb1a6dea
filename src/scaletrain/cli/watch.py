"""`scaletrain watch RUN_DIR`: the run's report served on localhost, brought up to date as
the run writes (diagnose/live.py); CLI glue only."""

from __future__ import annotations

import argparse
import signal
from typing import Any

from scaletrain.launch import startup


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    w = sub.add_parser(
        name,
        help="a live view of a run: its report on localhost, updated as metrics.jsonl grows",
        description="Serve RUN_DIR's report (findings and plots, as `scaletrain diagnose` draws them) on "
        "http://HOST:PORT/ and bring it up to date while the run writes; reads files only, never writes into RUN_DIR.",
    )
    w.add_argument("run_dir", metavar="RUN_DIR")
    w.add_argument("--port", type=int, default=8765, help="the port (default 8765; 0: any free one, printed)")
    w.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine only)")
    w.add_argument("--every", type=float, default=2.0, help="seconds between the page's checks for new rows (default 2)")
    return w


def run(args: argparse.Namespace) -> int:
    with startup.heavy_imports():
        from scaletrain.diagnose.live import LiveReport, serve

    live = LiveReport(args.run_dir, args.every)
    server = serve(live, args.host, args.port)
    port = server.server_address[1]
    print(f"watching {args.run_dir} at http://{args.host}:{port}/ (Ctrl-C stops)", flush=True)
    # Ctrl-C, or a kill, ends the serving with exit 0: set here, since a process started
    # with SIGINT ignored (a background job of a script, nohup) gets no handler from Python.
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, _interrupt)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
