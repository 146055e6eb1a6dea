"""`scaletrain bench`: CLI glue around scaletrain.bench (which never imports this).

--suite picks what is measured: loops (the default: scaletrain's loop against the others),
checkpoint (synchronous against background saves) or telemetry (its overhead). A suite
takes some of the options, with its own defaults (SUITES); an option it does not take is
refused in one line. Its module is imported when it runs, after its request was checked.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from scaletrain.bench.runner import check_request
from scaletrain.config import load_config, split_args
from scaletrain.errors import UserError
from scaletrain.strategies import STRATEGIES


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    b = sub.add_parser(
        name,
        help="scaletrain's loop against a hand-written loop on each engine (and HF Trainer, Accelerate)",
        description="Per engine, run scaletrain's loop and a minimal hand-written loop over the same engine (same "
        "model, batches, precision and world size) in alternating order, and print step time, tokens/s and peak memory "
        "(min / median / max over the rounds) with the paired ratio. --peers adds the Hugging Face model of the same "
        "shape under scaletrain, HF Trainer (ddp, zero2) and Accelerate (ddp). docs/benchmarks.md says how to read it. "
        "--suite checkpoint: how long the loop stands still per checkpoint, checkpoint.async_save=false against true "
        "(docs/checkpointing.md); --suite telemetry: what telemetry and the guards cost a step (docs/telemetry.md).",
    )
    # Options a suite does not take default to None: given, they are refused (_with_defaults).
    b.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    b.add_argument("--suite", choices=list(SUITES), default="loops", help="what to measure (default: loops)")
    b.add_argument("--strategies", help="comma-separated engines (default: all five)")
    b.add_argument("--nproc", type=int, help="processes per run (default 2; --suite checkpoint: 1)")
    b.add_argument(
        "--rounds",
        type=int,
        help="runs of each loop per engine, alternating (default 3); --suite telemetry: rounds of its A B runs (default 3; "
        "0: only the in-process measurements)",
    )
    b.add_argument(
        "--steps", type=int, help="steps per run; the first train.log_every are warm-up (default 100; --suite telemetry: 400)"
    )
    b.add_argument(
        "--peers", action="store_true", default=None, help="also HF Trainer and Accelerate (the optional extra scaletrain[bench])"
    )
    b.add_argument(
        "--out", help="where the runs and summary.json go (default runs/bench; --suite checkpoint | telemetry: runs/bench/SUITE)"
    )
    b.add_argument("--docs", metavar="FILE.md", help="write the table between the bench markers of FILE.md, and FILE.svg")
    b.add_argument("--json", action="store_true", default=None, help="print the summary as JSON")
    b.add_argument("--only", help="--suite clock: comma-separated configurations (default: all)")
    b.add_argument("--dry-run", action="store_true", help="print the command of each run, in order, and run nothing")
    return b


def run(args: argparse.Namespace) -> int:
    _with_defaults(args)
    return SUITES[args.suite].run(args)


def _loops(args: argparse.Namespace) -> int:
    if args.peers:
        _check_peers_installed()
    files, overrides = split_args(args.args)
    cfg = load_config(files, [*overrides, f"train.steps={args.steps}"])
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    check_request(cfg, strategies, args.nproc, args.rounds)
    from scaletrain.bench.loops import run_loops  # torch, the model, the data, a torchrun job per run

    return run_loops(
        cfg,
        strategies,
        nproc=args.nproc,
        rounds=args.rounds,
        peers=args.peers,
        out=Path(args.out),
        docs=Path(args.docs) if args.docs else None,
        as_json=args.json,
        dry_run=args.dry_run,
        command_line="scaletrain " + shlex.join(["bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else "scaletrain bench",
    )


def _checkpoint(args: argparse.Namespace) -> int:
    from scaletrain.bench.checkpoint_blocking import run_suite  # a `scaletrain train` (or launch) per mode

    return run_suite(args.args, out=Path(args.out), nproc=args.nproc, dry_run=args.dry_run, say=_progress)


def _telemetry(args: argparse.Namespace) -> int:
    from scaletrain.bench.telemetry_overhead import run_suite  # torch: the in-process measurements

    return run_suite(args.args, out=Path(args.out), nproc=args.nproc, rounds=args.rounds, steps=args.steps, dry_run=args.dry_run)


def _clock(args: argparse.Namespace) -> int:
    if args.dry_run or args.args:
        raise UserError("--suite clock runs its own configurations (scaletrain.bench.clock.CASES): no config, no --dry-run")
    from scaletrain.bench.clock import run_suite, table  # torch, the planner, a run per configuration and round

    only = [n.strip() for n in args.only.split(",")] if args.only else None
    results = run_suite(args.rounds, args.steps, Path(args.out), only, Path(args.docs) if args.docs else None, _progress)
    print(table(results, args.rounds, args.steps))
    return 0


def _recorded(args: argparse.Namespace) -> int:
    """--suite clock-gpu | clock-published: nothing runs; each recorded or published run is planned."""
    if args.dry_run or args.args:
        raise UserError(f"--suite {args.suite} plans its own runs: no config, no --dry-run")
    from scaletrain.bench.clock_recorded import compare_published, compare_recorded, table, write_between

    if args.suite == "clock-gpu":
        rows, marker, label = compare_recorded(Path(args.out), _progress), "clock-gpu-table", "measured"
    else:
        rows, marker, label = compare_published(_progress), "clock-published-table", "published"
    text = table(rows, label)
    if args.docs:
        write_between(Path(args.docs), marker, text)
    if args.json:
        print(json.dumps([r.__dict__ | {"error": r.error} for r in rows], indent=1))
    else:
        print(text)
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # stdout holds the table alone


@dataclass(frozen=True)
class Suite:
    options: dict[str, Any]  # the options it takes (besides --dry-run and the config), with its defaults
    run: Callable[[argparse.Namespace], int]


SUITES = {
    "loops": Suite(
        {
            "strategies": ",".join(STRATEGIES),
            "nproc": 2,
            "rounds": 3,
            "steps": 100,
            "peers": False,
            "out": "runs/bench",
            "docs": None,
            "json": False,
        },
        _loops,
    ),
    "checkpoint": Suite({"nproc": 1, "out": "runs/bench/checkpoint"}, _checkpoint),
    "telemetry": Suite({"nproc": 2, "rounds": 3, "steps": 400, "out": "runs/bench/telemetry"}, _telemetry),
    "clock": Suite({"rounds": 2, "steps": 12, "out": "runs/bench/clock", "docs": None, "only": None}, _clock),
    # --out: where the recorded runs are (their results.jsonl files), not where anything is written.
    "clock-gpu": Suite({"out": "docs/gpu", "docs": None, "json": False}, _recorded),
    "clock-published": Suite({"docs": None, "json": False}, _recorded),
}
OPTIONS = tuple(dict.fromkeys(o for suite in SUITES.values() for o in suite.options))


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _with_defaults(args: argparse.Namespace) -> None:
    """Fill in the suite's defaults; refuse, before anything runs, an option it does not take."""
    suite = SUITES[args.suite]
    foreign = [_flag(o) for o in OPTIONS if getattr(args, o) is not None and o not in suite.options]
    if foreign:
        accepted = ", ".join(_flag(o) for o in suite.options)
        raise UserError(
            f"{', '.join(foreign)}: not an option of --suite {args.suite}; accepted: {accepted}, --dry-run and the config"
        )
    for option, default in suite.options.items():
        if getattr(args, option) is None:
            setattr(args, option, default)


def _check_peers_installed() -> None:
    missing = [p for p in ("transformers", "accelerate") if find_spec(p) is None]
    if missing:
        raise UserError(f"--peers needs {' and '.join(missing)}; accepted: pip install 'scaletrain[bench]', or no --peers")
