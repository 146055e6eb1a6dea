"""`scaletrain eval RUN_OR_CHECKPOINT [key=value ...]`: the eval loss and perplexity of a
checkpoint, in one line (training/eval_checkpoint.py). Launched like train for several ranks:
`scaletrain launch --nproc N eval RUN ...`, or torchrun ... -m scaletrain eval RUN."""

from __future__ import annotations

import argparse

from scaletrain.config import split_args
from scaletrain.launch import startup


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    e = sub.add_parser(
        name,
        help="the eval loss of a checkpoint (a run's newest by default), at any world size and engine",
        description="Evaluate a checkpoint with its run's eval settings (eval.*; overridable, e.g. eval.batches=16 or "
        "eval.data=PATHS) and print one line: loss and perplexity. RUN_OR_CHECKPOINT: a run directory (its newest "
        "complete checkpoint) or a checkpoints/step_<N> directory.",
    )
    e.add_argument("target", metavar="RUN_OR_CHECKPOINT")
    e.add_argument("overrides", nargs="*", metavar="key=value")
    return e


def run(args: argparse.Namespace) -> int:
    files, overrides = split_args(args.overrides)
    if files:
        from scaletrain.errors import UserError

        raise UserError(f"scaletrain eval takes key=value overrides of the checkpoint's own config, not {files[0]}")
    with startup.heavy_imports():
        from scaletrain.training.eval_checkpoint import evaluate_checkpoint  # torch, the engines: once the arguments are known

    evaluate_checkpoint(args.target, overrides)
    return 0
