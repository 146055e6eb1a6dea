"""`scaletrain diagnose RUN_DIR` and `scaletrain compare RUN_A RUN_B ...`: CLI glue around
scaletrain.diagnose (which never imports this)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

SEVERITY_STYLE = {"warning": "bold yellow", "info": "cyan"}


def add_diagnose_parser(sub: Any) -> None:
    d = sub.add_parser(
        "diagnose",
        help="findings about a run (stragglers, communication, memory, hangs, ...) and report.html",
        description="Read a run directory (run.json, metrics.jsonl, ranks.jsonl, hang/, profile/) and print what "
        "slowed or broke the run, with evidence and advice; write RUN_DIR/report.html with plots.",
    )
    d.add_argument("run_dir", metavar="RUN_DIR")
    d.add_argument("--json", action="store_true", help="print the findings as JSON (severity, code, title, evidence, advice)")
    d.add_argument("--no-html", action="store_true", help="do not write RUN_DIR/report.html")
    d.set_defaults(func=cmd_diagnose)


def add_compare_parser(sub: Any) -> None:
    c = sub.add_parser(
        "compare",
        help="runs side by side: throughput, MFU, memory, cost per token, loss at equal tokens",
        description="Compare run directories: engine, layout, tokens/s, MFU, peak memory, GPU-hours per billion "
        "tokens, and each run's loss at the largest token count all of them reached.",
    )
    c.add_argument("runs", nargs="+", metavar="RUN_DIR")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(func=cmd_compare)


def _console() -> Console:
    console = Console(highlight=False)
    return console if console.is_terminal else Console(width=160, highlight=False)  # pipes and logs: never wrap


def cmd_diagnose(args: argparse.Namespace) -> int:
    from scaletrain.diagnose import diagnose, write_report

    findings = diagnose(args.run_dir)
    report = None if args.no_html else write_report(args.run_dir, findings)
    if args.json:
        print(json.dumps([f.as_dict() for f in findings], indent=1))
        if report is not None:  # stdout stays pure JSON
            print(f"report: {report}", file=sys.stderr)
        return 0
    console = _console()
    for f in findings:
        style = SEVERITY_STYLE.get(f.severity, "")
        console.print(f"[{style}]{f.severity}[/] {escape(f.title)} [dim]({escape(f.code)})[/]", soft_wrap=True)
        for line in f.evidence:
            console.print(f"    {escape(line)}", soft_wrap=True)
        if f.advice:
            console.print(f"    [green]advice:[/] {escape(f.advice)}", soft_wrap=True)
    warnings = sum(f.severity == "warning" for f in findings)
    console.print(f"{warnings} warning{'s' if warnings != 1 else ''}", soft_wrap=True)
    if report is not None:
        console.print(f"report: {escape(str(report))}", soft_wrap=True)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from scaletrain.diagnose import compare
    from scaletrain.diagnose.comparison import check_runs, print_comparison

    check_runs(args.runs)
    rows = compare(args.runs)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_comparison(rows, _console())
    return 0
