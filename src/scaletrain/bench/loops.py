"""`scaletrain bench` (--suite loops, the default): scaletrain's loop against hand-written
loops over each engine and, with peers, HF Trainer and Accelerate. The runs (runner.py),
their figures (report.py), printed, kept in OUT/summary.json and, with docs, written into a
page (docs/benchmarks.md)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from scaletrain.bench import report
from scaletrain.bench.runner import command, config_path, run_bench, run_path, schedule
from scaletrain.config import Config
from scaletrain.models import model_spec


def run_loops(
    cfg: Config,
    strategies: list[str],
    *,
    nproc: int,
    rounds: int,
    peers: bool,
    out: Path,
    docs: Path | None,
    as_json: bool,
    dry_run: bool,
    command_line: str,
) -> int:
    """The suite; `command_line` is what the figures say generated them. With `as_json`
    stdout is the summary alone (progress goes to stderr); `dry_run` prints each run's
    command, in the order they would run, and runs nothing."""
    if dry_run:
        for strategy, r, variant in schedule(strategies, rounds, peers):
            print(shlex.join(command(variant, config_path(out, strategy, variant), nproc, run_path(out, strategy, variant, r))))
        return 0
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if as_json else (lambda line: print(line, flush=True))
    bench = run_bench(cfg, strategies, nproc, rounds, peers, out, say)
    summary: dict[str, Any] = {
        "command": command_line,
        "machine": report.machine(peers),
        "nproc": nproc,
        "rounds": rounds,
        "shape": _shape(cfg, nproc, bench.vocab_size),
        "rows": report.summarize(bench),
        "loss_gaps": report.loss_gaps(bench),
        "runs": [vars(r) for r in bench.runs],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if docs:
        report.write_docs(docs, summary)
    if as_json:
        print(json.dumps(summary, indent=1))
        return 0
    cells = report.table(summary["rows"])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    print(f"\n{summary['shape']}; {rounds} rounds, alternating; step time: mean over each run after its first interval")
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    gaps = ", ".join(f"{e} {g:.2e}" for e, g in summary["loss_gaps"].items())
    print(f"largest loss difference scaletrain vs raw at the same step (round 1): {gaps}")
    print(f"runs and summary.json: {out}" + (f"; table written into {docs}" if docs else ""))
    return 0


def _shape(cfg: Any, nproc: int, vocab_size: int) -> str:
    t = cfg.train
    what = f"{cfg.model.preset} preset" if cfg.model.source == "builtin" else "Hugging Face model"
    counts = model_spec(cfg, vocab_size).counts()
    return (
        f"{what} ({counts.total / 1e6:.1f}M parameters), seq {cfg.data.seq_len}, micro-batch {t.micro_batch} x accum "
        f"{t.grad_accum} x {nproc} ranks, {cfg.precision}, device {cfg.run.device}"
    )
