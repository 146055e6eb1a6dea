"""`scaletrain bench`: CLI glue around scaletrain.bench (which never imports this)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError


def add_parser(sub: Any) -> None:
    b = sub.add_parser(
        "bench",
        help="scaletrain's loop against a hand-written loop on each engine (and HF Trainer, Accelerate)",
        description="Per engine, run scaletrain's loop and a minimal hand-written loop over the same engine (same "
        "model, batches, precision and world size) in alternating order, and print step time, tokens/s and peak memory "
        "(min / median / max over the rounds) with the paired ratio. --peers adds the Hugging Face model of the same "
        "shape under scaletrain, HF Trainer (ddp, zero2) and Accelerate (ddp). docs/benchmarks.md says how to read it.",
    )
    b.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    b.add_argument("--strategies", default="ddp,fsdp,zero1,zero2,zero3", help="comma-separated engines (default: all five)")
    b.add_argument("--nproc", type=int, default=2, help="processes per run (default 2)")
    b.add_argument("--rounds", type=int, default=3, help="runs of each loop per engine, alternating (default 3)")
    b.add_argument("--steps", type=int, default=100, help="steps per run; the first train.log_every are warm-up (default 100)")
    b.add_argument("--peers", action="store_true", help="also HF Trainer and Accelerate (the optional extra scaletrain[bench])")
    b.add_argument("--out", default="runs/bench", help="where the runs and summary.json go (default runs/bench)")
    b.add_argument("--docs", metavar="FILE.md", help="write the table between the bench markers of FILE.md, and FILE.svg")
    b.add_argument("--json", action="store_true", help="print the summary as JSON")
    b.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from scaletrain.bench import report, run_bench
    from scaletrain.config import load_config, split_args

    if args.peers:
        _check_peers_installed()
    files, overrides = split_args(args.args)
    cfg = load_config(files, [*overrides, f"train.steps={args.steps}"])
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else (lambda line: print(line, flush=True))
    out = Path(args.out)
    bench = run_bench(cfg, strategies, args.nproc, args.rounds, args.peers, out, say)
    summary = {
        "command": "scaletrain " + shlex.join(["bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else "scaletrain bench",
        "machine": report.machine(args.peers),
        "nproc": args.nproc,
        "rounds": args.rounds,
        "shape": _shape(cfg, args.nproc, bench.vocab_size),
        "rows": report.summarize(bench),
        "loss_gaps": report.loss_gaps(bench),
        "runs": [vars(r) for r in bench.runs],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.docs:
        report.write_docs(Path(args.docs), summary)
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    cells = report.table(summary["rows"])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    print(f"\n{summary['shape']}; {args.rounds} rounds, alternating; step time: mean over each run after its first interval")
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    gaps = ", ".join(f"{e} {g:.2e}" for e, g in summary["loss_gaps"].items())
    print(f"largest loss difference scaletrain vs raw at the same step (round 1): {gaps}")
    print(f"runs and summary.json: {out}" + (f"; table written into {args.docs}" if args.docs else ""))
    return 0


def _check_peers_installed() -> None:
    from importlib.util import find_spec

    missing = [p for p in ("transformers", "accelerate") if find_spec(p) is None]
    if missing:
        raise UserError(f"--peers needs {' and '.join(missing)}; accepted: pip install 'scaletrain[bench]', or no --peers")


def _shape(cfg: Any, nproc: int, vocab_size: int) -> str:
    from scaletrain.models import model_spec

    t = cfg.train
    what = f"{cfg.model.preset} preset" if cfg.model.source == "builtin" else "Hugging Face model"
    counts = model_spec(cfg, vocab_size).counts()
    return (
        f"{what} ({counts.total / 1e6:.1f}M parameters), seq {cfg.data.seq_len}, micro-batch {t.micro_batch} x accum "
        f"{t.grad_accum} x {nproc} ranks, {cfg.precision}, device {cfg.run.device}"
    )
