"""`scaletrain ckpt inspect | verify | convert | export`: checkpoints as files, in one process.

CKPT is a checkpoints/step_<N> directory, or a run directory (its newest whole checkpoint).
What each action does is ckpt_actions.py.
"""

from __future__ import annotations

import argparse

from scaletrain.launch import startup
from scaletrain.strategies import STRATEGIES


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    c = sub.add_parser(name, help="inspect, verify, convert or export checkpoints")
    actions = c.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)

    i = actions.add_parser("inspect", help="step, world size, engine, format, sizes and config of a checkpoint")
    i.add_argument("ckpt", metavar="CKPT")
    i.add_argument("--json", action="store_true", help="machine-readable output")

    v = actions.add_parser("verify", help="every file present, with the size and checksum recorded at save time")
    v.add_argument("ckpt", metavar="CKPT")

    cv = actions.add_parser(
        "convert",
        help="rewrite a checkpoint for another engine (any engine resumes any checkpoint by itself too)",
        description="Convert weights, optimizer state and trainer state (data position included) into the native "
        "format of another engine, in one process; the result resumes at any world size.",
    )
    cv.add_argument("src", metavar="SRC")
    cv.add_argument("dst", metavar="DST", help="the new checkpoint directory (must not exist)")
    cv.add_argument("--to", required=True, choices=STRATEGIES, help="the engine that will resume it")
    cv.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config changes for the target, e.g. parallel.offload_optimizer=cpu"
    )

    e = actions.add_parser("export", help="write Hugging Face safetensors + config.json + tokenizer")
    e.add_argument("ckpt", metavar="CKPT")
    e.add_argument("out", metavar="OUT", help="output directory (must not exist)")
    e.add_argument("--format", choices=["hf"], default="hf")
    e.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default="bf16")
    e.add_argument("--trainable-only", action="store_true", help="only the parameters training updated")
    e.add_argument(
        "--lora",
        choices=["merged", "adapter"],
        default="merged",
        help="a LoRA run: the base with the adapters folded in (merged), or the adapters alone in peft's format (adapter)",
    )
    e.add_argument("--tokenizer", metavar="TOKENIZER.json", help="default: the run's own (from its prepared data)")
    e.add_argument("--max-shard-size", default="2GiB", help="bytes per safetensors file, e.g. 5GB or 500MiB")
    return c


def run(args: argparse.Namespace) -> int:
    with startup.heavy_imports():
        from scaletrain.cli.ckpt_actions import ACTIONS  # torch.distributed.checkpoint, the engines (convert), safetensors

    return ACTIONS[args.ckpt_command](args)
