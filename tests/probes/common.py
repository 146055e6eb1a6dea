"""What the probes share: a model small enough to build in a blink, and building an engine
exactly as `train` does (spec, layout, the default parameter groups)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scaletrain.config import Config, load_config
from scaletrain.config.parallel import dims_for
from scaletrain.engines import Engine, build_engine
from scaletrain.launch.distributed import init_distributed, shutdown
from scaletrain.models import ModelSpec, distill_spec, model_spec
from scaletrain.optim.optimizers import decay_groups

Z3_PARTITION_ALL = "parallel.deepspeed_extra={zero_optimization: {stage3_param_persistence_threshold: 0}}"
SMALL_MODEL = ["model.vocab_size=67", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
               "model.ffn_dim=48", "data.seq_len=16", "train.micro_batch=2", "run.device=cpu"]  # fmt: skip


def build(overrides: list[str], world) -> tuple[Engine, ModelSpec, Config]:
    cfg = load_config([], overrides)
    spec = model_spec(cfg, None)
    distill = distill_spec(cfg, spec)
    dims = dims_for(cfg.parallel, world.world_size)
    engine = build_engine(spec, world, dims, cfg, decay_groups(cfg.train), distill.teacher if distill else None)
    return engine, spec, cfg


def run_strategies(probe_engine: Callable[[str, Any], dict]) -> None:
    """A probe's command line: --out DIR and the strategies to probe; each rank writes
    OUT/rank<R>.json, {strategy: probe_engine(strategy, world)}."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("strategies", nargs="+")
    args = ap.parse_args()
    world = init_distributed("cpu", "gloo")
    report = {strategy: probe_engine(strategy, world) for strategy in args.strategies}
    (Path(args.out) / f"rank{world.rank}.json").write_text(json.dumps(report))
    shutdown(world)
