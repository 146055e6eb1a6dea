"""`scaletrain diagnose` and `scaletrain compare`: what a finished (or stuck) run's directory says.

    findings = diagnose(run_dir)           # list[Finding], warnings first (findings.py)
    path = write_report(run_dir, findings) # run_dir/report.html, self-contained (report.py)
    rows = compare([run_a, run_b])         # one dict per run, losses at equal tokens (comparison.py)

A run directory as read (Run, load_run) and what is said about it (Finding) are in
run.py. The submodules are imported on first use: matplotlib only when a report is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scaletrain.diagnose.run import Finding, Run, load_run


def diagnose(run_dir: str | Path) -> list[Finding]:
    from scaletrain.diagnose.findings import diagnose_run

    return diagnose_run(load_run(run_dir))


def write_report(run_dir: str | Path, findings: list[Finding]) -> Path:
    from scaletrain.diagnose.report import write_report as write

    return write(run_dir, findings)


def compare(runs: list[str | Path]) -> list[dict[str, Any]]:
    """One dict per run, in the order given, losses at equal tokens (comparison.py)."""
    from scaletrain.diagnose.comparison import compare_runs

    return compare_runs(runs)


__all__ = ["Finding", "Run", "compare", "diagnose", "load_run", "write_report"]
