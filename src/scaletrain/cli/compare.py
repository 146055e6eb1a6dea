"""`scaletrain compare RUN_A RUN_B ...`: CLI glue around scaletrain.diagnose's comparison
(which never imports this)."""

from __future__ import annotations

import argparse
import json

from scaletrain.cli.console import console
from scaletrain.launch import startup


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    c = sub.add_parser(
        name,
        help="runs side by side: throughput, MFU, memory, cost per token, loss at equal tokens",
        description="Compare run directories: engine, layout, tokens/s, MFU, peak memory, GPU-hours per billion "
        "tokens, and each run's loss at the largest token count all of them reached.",
    )
    c.add_argument("runs", nargs="+", metavar="RUN_DIR")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    return c


def run(args: argparse.Namespace) -> int:
    with startup.heavy_imports():
        from scaletrain.diagnose.comparison import check_runs, compare_runs, print_comparison  # the run readers

    check_runs(args.runs)
    rows = compare_runs(args.runs)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_comparison(rows, console(highlight=False))
    return 0
