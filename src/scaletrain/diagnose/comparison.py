"""`scaletrain compare`: runs side by side, their losses taken at the same number of tokens.

Losses are compared at equal tokens, not equal steps: runs with another global batch (world
size, micro-batch, accumulation) see different amounts of data per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from scaletrain.diagnose.run import Run, gib, hours_unit, load_run, median_of
from scaletrain.errors import UserError


def compare_runs(runs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """scaletrain.diagnose.compare: one dict per run, in the order given;
    `loss_at_equal_tokens` is each run's loss at `equal_tokens`, the largest token count
    every run reached (how: `loss_method`)."""
    loaded = [load_run(r) for r in runs]
    reached = [t for t in map(_max_tokens, loaded) if t is not None]
    equal = min(reached) if reached and len(reached) == len(loaded) else None
    lacking = ", ".join(str(name) for run, name in zip(loaded, runs) if _max_tokens(run) is None)
    return [_row(run, name, equal, f"not computed: no token counts in {lacking}") for run, name in zip(loaded, runs)]


def _max_tokens(run: Run) -> int | None:
    tokens = [r["tokens"] for r in run.steps if isinstance(r.get("tokens"), int | float)]
    return int(max(tokens)) if tokens else None


def _row(run: Run, name: str | Path, equal: int | None, why_not: str) -> dict[str, Any]:
    cfg, last_iv = run.config, (run.intervals[-1] if run.intervals else {})
    peaks = [e["mem_peak_bytes"] for e in run.intervals if e.get("mem_peak_bytes")]
    tokens = _max_tokens(run)
    gpu_hours = last_iv.get("gpu_hours")
    loss, how = loss_at(run.steps, equal) if equal is not None else (None, why_not)
    return {
        "run": str(name),
        "engine": run.engine,
        "device": run.info.get("device"),  # what its gpu_hours count: cpu runs' are CPU-hours
        "world": run.info.get("world_size"),
        "micro_batch": cfg.train.micro_batch if cfg else None,
        "grad_accum": cfg.train.grad_accum if cfg else None,
        "precision": run.info.get("precision") or (cfg.precision if cfg else None),
        "tokens_per_s": median_of(run.intervals, "tokens_per_s"),
        "mfu": median_of(run.intervals, "mfu"),
        "peak_memory_bytes": max(peaks) if peaks else None,
        "tokens": tokens,
        "gpu_hours": gpu_hours,
        "gpu_hours_per_billion_tokens": gpu_hours / (tokens / 1e9) if gpu_hours is not None and tokens else None,
        "equal_tokens": equal,
        "loss_at_equal_tokens": loss,
        "loss_method": how,
    }


def loss_at(steps: list[dict[str, Any]], tokens: int) -> tuple[float | None, str]:
    """The loss at `tokens`: a step row's own when one ends there, else linear interpolation
    between the two step rows around it (a step's loss belongs to the tokens it ended at)."""
    pts = sorted(
        (r["tokens"], r["loss"], r["step"])
        for r in steps
        if isinstance(r.get("tokens"), int | float) and isinstance(r.get("loss"), int | float)
    )
    for i, (t1, l1, s1) in enumerate(pts):
        if t1 == tokens:
            return float(l1), f"step {s1} (exactly)"
        if t1 > tokens:
            if i == 0:
                return None, f"its first step (step {s1}) is already past {tokens:,} tokens"
            t0, l0, s0 = pts[i - 1]
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0), f"interpolated between steps {s0} and {s1}"
    return None, f"it never reached {tokens:,} tokens"


def _cell(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def print_comparison(rows: list[dict[str, Any]], console: Console) -> None:
    names = [Path(r["run"]).name or r["run"] for r in rows]
    if len(set(names)) < len(names):  # same leaf names (runs/a/x, runs/b/x): show the paths given
        names = [r["run"] for r in rows]
    table = Table(pad_edge=False, show_lines=False)
    table.add_column("")
    for name in names:
        table.add_column(escape(name), justify="right", no_wrap=True)
    lines: list[tuple[str, Any]] = [
        ("engine", lambda r: _cell(r["engine"])),
        ("world", lambda r: _cell(r["world"])),
        ("micro-batch x grad_accum", lambda r: f"{_cell(r['micro_batch'])} x {_cell(r['grad_accum'])}"),
        ("precision", lambda r: _cell(r["precision"])),
        ("tokens/s (median)", lambda r: _cell(r["tokens_per_s"], "{:,.0f}")),
        ("MFU", lambda r: "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"),
        ("peak memory", lambda r: "-" if r["peak_memory_bytes"] is None else gib(r["peak_memory_bytes"])),
        ("tokens", lambda r: _cell(r["tokens"], "{:,}")),
        (
            f"{hours_unit([r['device'] for r in rows])} per 1B tokens",
            lambda r: _cell(r["gpu_hours_per_billion_tokens"], "{:.3g}"),
        ),
        ("loss at equal tokens *", lambda r: _cell(r["loss_at_equal_tokens"], "{:.4f}")),
    ]
    for label, show in lines:
        table.add_row(label, *(escape(show(r)) for r in rows))
    console.print(table)
    equal = rows[0]["equal_tokens"] if rows else None
    where = f"{equal:,} tokens, the most every run reached" if equal is not None else "equal tokens"
    console.print(f"* loss at {where}:", highlight=False, soft_wrap=True)
    for name, r in zip(names, rows):
        console.print(f"  {escape(name)}: {escape(r['loss_method'])}", highlight=False, soft_wrap=True)


def check_runs(runs: Sequence[str]) -> None:
    if len(runs) < 2:
        raise UserError(
            f"compare needs two or more run directories, got {len(runs)}; accepted: scaletrain compare RUN_A RUN_B ..."
        )
