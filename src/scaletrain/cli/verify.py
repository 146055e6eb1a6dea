"""`scaletrain verify RUN [--from STEP] [--steps N] [--nproc M]`: re-run N steps of a run from
one of its checkpoints and compare what it recorded (training/verify.py). Exit 0 when the
same, 1 when not."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    v = sub.add_parser(
        name,
        help="re-run steps of a run from a checkpoint and compare them with what it recorded (a resume audited)",
        description="Re-run --steps steps of RUN from its checkpoint at --from (the newest by default) into a scratch "
        "directory and compare each step's loss, gradient norm, learning rate, tokens and counters, and each "
        "evaluation, with RUN's metrics.jsonl: bit for bit on the run's own world size, within the engines' equivalence "
        "tolerances on another (--nproc). Prints the first step that differs and by how much; exit 0 the same, 1 not.",
    )
    v.add_argument("run", metavar="RUN")
    v.add_argument("--from", dest="from_step", type=int, default=None, metavar="STEP", help="the checkpoint's step")
    v.add_argument("--steps", type=int, default=None, metavar="N", help="steps to re-run (default 5, at most to the run's last)")
    v.add_argument("--nproc", type=int, default=None, metavar="M", help="ranks to re-run on (default: the run's world size)")
    v.add_argument("--scratch", type=Path, default=None, help="where the re-run goes (default: RUN/verify, replaced)")
    return v


def run(args: argparse.Namespace) -> int:
    from scaletrain.errors import UserError

    for name in ("from_step", "steps", "nproc"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "from_step" else 1):
            flag = "--from" if name == "from_step" else f"--{name}"
            raise UserError(f"{flag} {value}: accepted: an integer >= {0 if name == 'from_step' else 1}")
    from scaletrain.training.verify import verify

    return verify(args.run, args.from_step, args.steps, args.nproc, args.scratch)
