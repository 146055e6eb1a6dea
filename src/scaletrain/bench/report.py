"""The bench's figures: per engine and loop min / median / max over the rounds, the paired
ratios, the machine, and the same as a table in docs/benchmarks.md with a plot."""

from __future__ import annotations

import os
import platform
import statistics
from datetime import date
from importlib import metadata
from pathlib import Path
from typing import Any

from scaletrain.bench.runner import Bench, Run

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
# What each loop is compared with: the same engine and model, another loop.
BASELINE = {"scaletrain": "raw", "hf-trainer": "scaletrain-hf", "accelerate": "scaletrain-hf"}
MiB = 2**20


def spread(values: list[float]) -> list[float]:
    return [min(values), statistics.median(values), max(values)]


def summarize(bench: Bench) -> list[dict[str, Any]]:
    """One row per (engine, loop), in run order: step time, tokens/s and peak memory over
    the rounds, and the step time over its baseline's in the same round (paired)."""
    rows = []
    for engine in bench.strategies:
        runs = [r for r in bench.runs if r.engine == engine]
        for loop in dict.fromkeys(r.variant for r in runs):
            mine = sorted((r for r in runs if r.variant == loop), key=lambda r: r.round)
            base = {r.round: r for r in runs if r.variant == BASELINE.get(loop)}
            ratios = [r.step_s / base[r.round].step_s for r in mine if r.round in base]
            rows.append(
                {
                    "engine": engine,
                    "loop": loop,
                    "step_s": spread([r.step_s for r in mine]),
                    "tokens_per_s": spread([r.tokens_per_s for r in mine]),
                    "peak_bytes": spread([float(r.peak_bytes) for r in mine]),
                    "final_loss": statistics.median(r.final_loss for r in mine),
                    "vs": BASELINE.get(loop) if ratios else None,
                    "ratio": spread(ratios) if ratios else None,
                }
            )
    return rows


def loss_gaps(bench: Bench) -> dict[str, float]:
    """Per engine, the largest difference between scaletrain's and the raw loop's loss at
    the same step (first round): the two do the same work only if it is small."""
    gaps = {}
    for engine in bench.strategies:
        first = {r.variant: r for r in bench.runs if r.engine == engine and r.round == 0}
        if "scaletrain" in first and "raw" in first:
            gaps[engine] = _gap(first["scaletrain"], first["raw"])
    return gaps


def _gap(a: Run, b: Run) -> float:
    theirs = dict((int(s), v) for s, v in b.losses)
    common = [(v, theirs[int(s)]) for s, v in a.losses if int(s) in theirs]
    if not common:
        raise ValueError(f"the {a.variant} and {b.variant} runs of {a.engine} logged no common step")
    return max(abs(x - y) for x, y in common)


def machine(peers: bool) -> dict[str, Any]:
    import torch

    cpu = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), platform.processor() or "?"
    )
    packages = ["torch", "deepspeed"] + (["transformers", "accelerate"] if peers else [])
    info: dict[str, Any] = {
        "date": date.today().isoformat(),
        "cpu": cpu,
        "cores": len(_affinity()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "versions": {p: metadata.version(p) for p in packages},
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _affinity() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def table(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Header and rows as text cells (the terminal and the markdown show the same)."""
    out = [
        ["engine", "loop", "step ms: min / median / max", "tokens/s (median)", "peak MiB (median)", "last loss", "step time ÷"]
    ]
    for r in rows:
        lo, med, hi = (1000 * v for v in r["step_s"])
        ratio = f"{r['ratio'][1]:.3f} ({r['ratio'][0]:.3f}-{r['ratio'][2]:.3f}) {r['vs']}" if r["ratio"] else ""
        out.append(
            [
                r["engine"],
                r["loop"],
                f"{lo:.1f} / {med:.1f} / {hi:.1f}",
                f"{r['tokens_per_s'][1]:,.0f}",
                f"{r['peak_bytes'][1] / MiB:,.0f}",
                f"{r['final_loss']:.3f}",
                ratio,
            ]
        )
    return out


def markdown_table(cells: list[list[str]]) -> str:
    lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells[1:]])


def write_docs(path: Path, summary: dict[str, Any]) -> Path:
    """Replace the generated part of `path` (between the bench markers) and write the plot
    beside it; the prose around the markers is kept. A new file gets the markers only."""
    plot = path.with_suffix(".svg")
    _plot(summary["rows"], plot)
    m = summary["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    where = f"{m['cores']} CPU cores ({m['cpu']}, torch CPU capability {m['cpu_capability']})" + (
        f", {m['gpu']}" if "gpu" in m else ""
    )
    gaps = ", ".join(f"{e} {g:.2e}" for e, g in summary["loss_gaps"].items())
    block = "\n".join(
        [
            START,
            f"Generated by `{summary['command']}` on {m['date']}: {where}; Python {m['python']}, {versions}.",
            "",
            f"{summary['rounds']} rounds, {summary['nproc']} processes, {summary['shape']}.",
            "",
            markdown_table(table(summary["rows"])),
            "",
            f"Largest loss difference between scaletrain's loop and the raw loop at the same step (round 1): {gaps}.",
            "",
            f"![tokens/s per engine and loop]({plot.name})",
            END,
        ]
    )
    text = path.read_text() if path.is_file() else f"# Benchmarks\n\n{START}\n{END}\n"
    if START not in text or END not in text:
        text = text.rstrip("\n") + f"\n\n{START}\n{END}\n"
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    path.write_text(head + block + tail)
    return plot


def _plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['engine']}\n{r['loop']}" for r in rows]
    med = [r["tokens_per_s"][1] for r in rows]
    err = [[m - r["tokens_per_s"][0] for m, r in zip(med, rows)], [r["tokens_per_s"][2] - m for m, r in zip(med, rows)]]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 3.6))
    colours = {"scaletrain": "#1f77b4", "raw": "#7f7f7f", "scaletrain-hf": "#17becf"}
    ax.bar(range(len(rows)), med, yerr=err, capsize=3, color=[colours.get(r["loop"], "#ff7f0e") for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("tokens/s (median; bars: min-max)")
    ax.set_title("scaletrain bench")
    fig.tight_layout()
    plt.rcParams["svg.hashsalt"] = "scaletrain"  # the same figure gives the same file
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)
