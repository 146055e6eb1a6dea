"""`scaletrain diagnose RUN_DIR`: CLI glue around scaletrain.diagnose (which never imports this)."""

from __future__ import annotations

import argparse
import json
import sys

from rich.markup import escape

from scaletrain.cli.console import console
from scaletrain.launch import startup

SEVERITY_STYLE = {"warning": "bold yellow", "info": "cyan"}


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    d = sub.add_parser(
        name,
        help="findings about a run (stragglers, communication, memory, hangs, ...) and report.html",
        description="Read a run directory (run.json, metrics.jsonl, ranks.jsonl, hang/, profile/) and print what "
        "slowed or broke the run, with evidence and advice; write RUN_DIR/report.html with plots.",
    )
    d.add_argument("run_dir", metavar="RUN_DIR")
    d.add_argument("--json", action="store_true", help="print the findings as JSON (severity, code, title, evidence, advice)")
    d.add_argument("--no-html", action="store_true", help="do not write RUN_DIR/report.html")
    return d


def run(args: argparse.Namespace) -> int:
    with startup.heavy_imports():
        from scaletrain.diagnose import diagnose, write_report  # the findings, the report's plots

    findings = diagnose(args.run_dir)
    report = None if args.no_html else write_report(args.run_dir, findings)
    if args.json:
        print(json.dumps([f.as_dict() for f in findings], indent=1))
        if report is not None:  # stdout stays pure JSON
            print(f"report: {report}", file=sys.stderr)
        return 0
    shown = console(highlight=False)
    for f in findings:
        style = SEVERITY_STYLE.get(f.severity, "")
        shown.print(f"[{style}]{f.severity}[/] {escape(f.title)} [dim]({escape(f.code)})[/]", soft_wrap=True)
        for line in f.evidence:
            shown.print(f"    {escape(line)}", soft_wrap=True)
        if f.advice:
            shown.print(f"    [green]advice:[/] {escape(f.advice)}", soft_wrap=True)
    warnings = sum(f.severity == "warning" for f in findings)
    shown.print(f"{warnings} warning{'s' if warnings != 1 else ''}", soft_wrap=True)
    if report is not None:
        shown.print(f"report: {escape(str(report))}", soft_wrap=True)
    return 0
