"""`scaletrain train`: the embedded default, or YAML files merged in order and dotted overrides."""

from __future__ import annotations

import argparse

from scaletrain.config import load_config, split_args


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    t = sub.add_parser(
        name,
        help="train a model (embedded default when no config is given)",
        description="Train. YAML files are merged in order, then dotted overrides such as train.lr=3e-4 apply.",
    )
    t.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    return t


def run(args: argparse.Namespace) -> int:
    cfg = load_config(*split_args(args.args))
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from scaletrain.launch import startup

    with startup.heavy_imports():  # torch, the engine: once the config is known to be good
        from scaletrain.engines import preload
        from scaletrain.training.trainer import train

        preload(cfg)
    train(cfg)
    return 0
