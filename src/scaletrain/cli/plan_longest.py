"""`scaletrain plan --longest-sequence`: the longest sequence each layout fits
(planning/longest.py), as a table or JSON."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from scaletrain.cli.console import console
from scaletrain.config import Config
from scaletrain.errors import UserError
from scaletrain.planning import planning_spec
from scaletrain.planning.hardware import GiB, fmt, gpu, parse_size, this_cpu
from scaletrain.planning.longest import MAX_TOKENS, longest_sequences
from scaletrain.telemetry.progress import model_label

MARKS = {"": "", "positions": " (max)", "search": " (limit)"}
TERMS = ("params", "grads", "optimizer", "activations", "loss", "buffers", "peak", "cpu")


def show_longest(cfg: Config, opts: argparse.Namespace) -> int:
    for name, value in (("--gpus-per-node", opts.gpus_per_node), ("--nodes", opts.nodes)):
        if value < 1:
            raise UserError(f"{name} {value} is invalid; accepted: 1 or more")
    model = planning_spec(cfg)
    device = this_cpu() if (opts.gpu or "").lower() == "cpu" else gpu(opts.gpu, opts.gpu_memory)
    cpu_per_node = parse_size(opts.cpu_memory, "--cpu-memory") if opts.cpu_memory else None
    world = opts.gpus_per_node * opts.nodes
    usable = device.memory * (1 - opts.headroom)
    rows = longest_sequences(cfg, model, world, opts.nodes, device, usable, cpu_per_node)
    if opts.json:
        out = [
            {"layout": r.layout, "seq_len": r.seq_len, "limit": r.limit, "capped": r.capped, "step_time_s": r.candidate.step_time}
            | {k: float(getattr(r.candidate.memory, k)) for k in TERMS}
            for r in rows
        ]
        print(json.dumps({"world": world, "usable_bytes": usable, "longest": out}, indent=1))
        return 0
    shown = console()
    shown.print(
        f"[bold]longest sequence per layout for model {model_label(cfg, model)}[/]: {world} x {device.name}, "
        f"{fmt(device.memory)} each, {fmt(usable)} usable; one sequence per micro-batch, activation checkpointing",
        highlight=False,
        soft_wrap=True,
    )
    table = Table(
        pad_edge=False,
        caption="memory in GiB per device at that length; host = held on the host per device; (max): the model's positions "
        "stop it; (limit): the search's end",
    )
    table.add_column("layout", no_wrap=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    for col in ("params", "grads", "optim", "activ", "loss", "buffers", "peak", "host", "s/step", "peak at"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        m = r.candidate.memory
        table.add_row(
            r.layout,
            (f"{r.seq_len:,}" if r.seq_len else "none") + MARKS[r.capped],
            *(f"{getattr(m, k) / GiB:.1f}" for k in TERMS[:-1]),
            f"{m.cpu / GiB:.1f}" if m.cpu else "-",
            f"{r.candidate.step_time:.3g}" if r.seq_len else "-",
            r.limit,
        )
    shown.print(table)
    best = max(rows, key=lambda r: r.seq_len)
    if best.seq_len:
        said = (
            f"  - longest: {best.seq_len:,} tokens with {best.layout} (peak {fmt(best.candidate.memory.peak)}, "
            f"estimated {best.candidate.step_time:.3g} s per step of one sequence per data-parallel rank); its peak: "
            f"{best.limit}"
        )
        if best.capped == "positions":
            said += f"; the model's max_position_embeddings ({getattr(model, 'max_positions', 0):,}) stops it, not memory"
        elif best.capped:
            said += f"; the search ends at {MAX_TOKENS:,} tokens: memory would hold more"
    else:
        least = min(rows, key=lambda r: r.candidate.memory.peak)
        said = (
            f"  - none fits even {least.candidate.setup.seq_len:,} tokens: the lowest peak, {least.layout}'s, is "
            f"{fmt(least.candidate.memory.peak)} of {fmt(usable)} usable, at the {least.limit}; more devices "
            "(--gpus-per-node, --nodes) shard the states further"
        )
    shown.print(said, highlight=False, soft_wrap=True)
    return 0
