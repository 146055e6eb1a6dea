"""report.html: the findings and five plots in one file that needs nothing at view time (one
more with downstream tasks: their accuracy against tokens trained; one more for a mixture
of experts: the expert load per layer over the run, as a heat map).

Plots are matplotlib SVG inlined into the page (glyphs as paths, so no font is loaded) and
a Content-Security-Policy forbids every fetch: the report opens the same on an air-gapped
cluster, from an e-mail attachment, or years later.
"""

from __future__ import annotations

import html
import io
import math
import os
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from scaletrain.diagnose.experts import moe_intervals
from scaletrain.diagnose.run import Finding, GiB, Run, load_run

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PHASES = ("data_s", "forward_s", "backward_s", "optimizer_s", "comm_s")
COLORS = ("#8c564b", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#7f7f7f")  # the phases, then other
MAX_LEGEND = 8  # more ranks than this: lines without a legend, which would hide the plot
# The heat map is vector (a path per cell: an embedded raster would be a data: URI, which
# the page's policy forbids). A cell is ~290 bytes of SVG: past MAX_CELLS (about 1 MB),
# neighbouring intervals merge into one column; past MAX_ROWS (layers x experts), the
# most imbalanced layers are shown.
MAX_CELLS = 3500
MAX_ROWS = 256

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1100px; color: #222; }
h1 { font-size: 22px; margin-bottom: 4px; } .meta { color: #666; margin-top: 0; }
.finding { border-left: 5px solid #1f77b4; background: #f4f8fc; padding: 8px 14px; margin: 10px 0; }
.finding.warning { border-color: #e67e22; background: #fdf5ec; }
.finding h3 { margin: 2px 0 4px; font-size: 15px; } .finding ul { margin: 4px 0; padding-left: 20px; }
.sev { font-size: 12px; text-transform: uppercase; letter-spacing: .05em; margin-right: 8px; color: #1f77b4; }
.warning .sev { color: #c0600b; } .advice { margin: 4px 0; } .code { color: #888; font: 12px monospace; }
figure.plot { margin: 18px 0; } figure.plot svg { width: 100%; height: auto; }
figcaption { font-weight: 600; margin-bottom: 4px; } .nodata { color: #888; font-style: italic; }
"""


def write_report(run_dir: str | Path, findings: list[Finding]) -> Path:
    run = load_run(run_dir)
    path = run.root / "report.html"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render(run, findings), encoding="utf-8")
    os.replace(tmp, path)  # a reader (a browser reloading) never sees half a report
    return path


POLICY = "default-src 'none'; style-src 'unsafe-inline'"  # no script, no fetch: report.html as a file


def render(run: Run, findings: list[Finding]) -> str:
    return page_head(run, POLICY) + render_body(run, findings) + "</body></html>\n"


def page_head(run: Run, policy: str) -> str:
    """The page up to its body's content: the title, the style, the Content-Security-Policy."""
    e = html.escape
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{e(policy, quote=False)}">\n'
        f"<title>scaletrain diagnose: {e(run.root.name)}</title>\n<style>{_CSS}</style></head>\n<body>\n"
        f"<h1>scaletrain diagnose: {e(run.root.name)}</h1>\n"
    )


def render_body(run: Run, findings: list[Finding]) -> str:
    """What the files say: the findings and the plots (the live view's fragment too: live.py)."""
    e = html.escape
    n_warn = sum(f.severity == "warning" for f in findings)
    meta = (
        f'<p class="meta">{e(str(run.root.resolve()))} &middot; {n_warn} warning{"s" if n_warn != 1 else ""} &middot; '
        f"written {e(datetime.now(UTC).isoformat(timespec='seconds'))}</p>\n"
    )
    parts = [meta, '<section id="findings"><h2>Findings</h2>\n', *(_finding(f) for f in findings), "</section>\n"]
    parts.append('<section id="plots"><h2>Plots</h2>\n')
    tasks = TASK_PLOT if run.events_of("task") else ()  # beside the loss: what the model can do
    for plot_id, caption, draw in PLOTS[:1] + tasks + PLOTS[1:] + (EXPERT_PLOT if moe_intervals(run) else ()):
        parts.append(
            f'<figure class="plot" id="{plot_id}"><figcaption>{e(caption)}</figcaption>\n{_plot(plot_id, draw, run)}</figure>\n'
        )
    parts.append("</section>\n")
    return "".join(parts)


def _finding(f: Finding) -> str:
    e = html.escape
    items = "".join(f"<li>{e(line)}</li>" for line in f.evidence)
    advice = f'<p class="advice"><b>advice:</b> {e(f.advice)}</p>' if f.advice else ""
    return (
        f'<div class="finding {e(f.severity)}" data-code="{e(f.code, quote=True)}" data-severity="{e(f.severity, quote=True)}">'
        f'<h3><span class="sev">{e(f.severity)}</span>{e(f.title)} <span class="code">{e(f.code)}</span></h3>'
        f"<ul>{items}</ul>{advice}</div>\n"
    )


def _plot(plot_id: str, draw: Callable[[Axes, Run], str | None], run: Run) -> str:
    """The plot as inline SVG, or a note saying which data it lacks."""
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    fig = Figure(figsize=(9, 3.4), layout="constrained")
    ax = fig.add_subplot()
    ax.grid(True, alpha=0.3)  # before drawing, so that a plot can turn it off
    missing = draw(ax, run)
    if missing:
        return f'<p class="nodata">no data: {html.escape(missing)}</p>\n'

    buf = io.StringIO()
    # A salt per plot: ids (clip paths) stay unique across the SVGs sharing one document.
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": plot_id}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _loss(ax: Axes, run: Run) -> str | None:
    pts = [(r["step"], r["loss"]) for r in run.steps if isinstance(r.get("loss"), int | float)]
    if not pts:
        return "metrics.jsonl has no step rows with a loss"
    ax.plot(*zip(*pts), lw=1.2, color="#1f77b4", label="training (each step's batch)")
    # Evaluations (training/evaluation.py) on the same axes: the gap between the curves is what
    # the held-out loss says about overfitting.
    evals = [(e["step"], e["loss"]) for e in run.events_of("eval") if isinstance(e.get("loss"), int | float)]
    if evals:
        ax.plot(*zip(*evals), marker="o", ms=3, lw=1.2, color="#d62728", label="eval (the fixed held-out windows)")
    # A mixture of experts: the loss rows are the cross entropy; what the routers' terms added
    # to the objective (per forward, each interval's) on an axis of their own, apart.
    routers = [(e["step"], e["moe"]["aux"]) for e in run.intervals if isinstance((e.get("moe") or {}).get("aux"), int | float)]
    lines = list(ax.get_lines())
    if routers:
        right = ax.twinx()
        lines += right.plot(*zip(*routers), marker="s", ms=3, lw=1.0, color="#9467bd", label=ROUTERS)
        right.set_ylabel("routers' terms")
    if len(lines) > 1:
        ax.legend(lines, [str(line.get_label()) for line in lines], loc="upper right", fontsize=8)
    ax.set(xlabel="step", ylabel="loss")
    return None


ROUTERS = "MoE routers' terms (moe.aux, right axis)"


def _lr(ax: Axes, run: Run) -> str | None:
    pts = [(r["step"], r["lr"]) for r in run.steps if isinstance(r.get("lr"), int | float)]
    if not pts:
        return "metrics.jsonl has no step rows with an lr"
    ax.plot(*zip(*pts), lw=1.2, color="#1f77b4", label="the schedule (train.lr)")
    # Each optimizer group's rate at the end of each interval, where the groups differ
    # (train.param_groups' multipliers; Muon beside AdamW): the rows optim/optimizers.py's
    # group_lrs writes, numbered as the run's start printed the groups.
    groups: dict[int, list[tuple[int, float]]] = {}
    labels: dict[int, str] = {}
    for e in run.intervals:
        for g in e.get("lr_groups") or []:
            groups.setdefault(g["group"], []).append((e["step"], g["lr"]))
            kind = f"{g['optimizer']}, " if g.get("optimizer") else ""
            labels[g["group"]] = f"group {g['group']} ({kind}lr x {g['lr_scale']:g})"
    for i, line in sorted(groups.items()):
        ax.plot(*zip(*line), marker="o", ms=3, lw=1.0, label=labels[i])
    if groups:
        ax.legend(loc="upper right", fontsize=8)
    ax.set(xlabel="step", ylabel="learning rate")
    ax.set_ylim(bottom=0)
    return None


def _throughput(ax: Axes, run: Run) -> str | None:
    pts = [(e["step"], e["tokens_per_s"]) for e in run.intervals if isinstance(e.get("tokens_per_s"), int | float)]
    if not pts:
        return "metrics.jsonl has no interval events with tokens_per_s"
    ax.plot(*zip(*pts), marker="o", ms=3, lw=1.2, color="#2ca02c")
    ax.set(xlabel="step (end of log interval)", ylabel="tokens/s")
    ax.set_ylim(bottom=0)
    return None


def breakdown(run: Run) -> dict[int, dict[str, float]]:
    """Mean seconds per step of each phase per rank over ranks.jsonl (intervals weighted by
    their steps: saves cut some short), the first interval (warm-up) left out when there are
    later ones; `other_s` is the rest of step_s."""
    steps = sorted({r["step"] for r in run.ranks if "step" in r})
    rows = [r for r in run.ranks if r.get("step") != steps[0]] if len(steps) > 1 else run.ranks
    sums: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    counts: dict[int, float] = defaultdict(float)
    for r in rows:
        if "rank" not in r or not r.get("step_s"):
            continue
        rank, weight = int(r["rank"]), float(r.get("steps") or 1)
        counts[rank] += weight
        phases = {p: float(r.get(p) or 0.0) for p in PHASES}
        for p, v in phases.items():
            sums[rank][p] += weight * v
        sums[rank]["other_s"] += weight * max(float(r["step_s"]) - sum(phases.values()), 0.0)
    return {rank: {k: v / counts[rank] for k, v in sums[rank].items()} for rank in sorted(sums)}


def _breakdown(ax: Axes, run: Run) -> str | None:
    per_rank = breakdown(run)
    if not per_rank:
        return "no ranks.jsonl (per-rank step breakdown)"
    ranks = list(per_rank)
    bottom = [0.0] * len(ranks)
    for phase, color in zip((*PHASES, "other_s"), COLORS):
        values = [per_rank[r].get(phase, 0.0) for r in ranks]
        ax.bar([str(r) for r in ranks], values, bottom=bottom, color=color, label=phase.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel="rank", ylabel="seconds per step (mean)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return None


def _memory(ax: Axes, run: Run) -> str | None:
    per_rank: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for r in run.ranks:
        if "rank" in r and isinstance(r.get("mem_peak_bytes"), int | float):
            per_rank[int(r["rank"])].append((r["step"], r["mem_peak_bytes"] / GiB))
    if not per_rank:  # older runs: the interval events' largest peak of any rank
        peaks = [
            (e["step"], e["mem_peak_bytes"] / GiB) for e in run.intervals if isinstance(e.get("mem_peak_bytes"), int | float)
        ]
        if not peaks:
            return "no memory peaks in ranks.jsonl or the interval events"
        per_rank[-1] = peaks
    for rank, pts in sorted(per_rank.items()):
        ax.plot(*zip(*sorted(pts)), marker="o", ms=2, lw=1, label="largest of any rank" if rank < 0 else f"rank {rank}")
    capacity = [e["mem_capacity_bytes"] for e in run.intervals if e.get("mem_capacity_bytes")]
    if capacity:
        ax.axhline(max(capacity) / GiB, color="#d62728", ls="--", lw=1, label="device capacity")
    ax.set(xlabel="step (end of log interval)", ylabel="peak memory (GiB)")
    ax.set_ylim(bottom=0)
    if len(per_rank) <= MAX_LEGEND:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return None


def _tasks(ax: Axes, run: Run) -> str | None:
    """Each downstream task's accuracy (eval.tasks) against the tokens trained when it was
    scored: acc solid, acc_norm dashed in the same colour."""
    tokens = {r["step"]: r["tokens"] for r in run.steps if isinstance(r.get("tokens"), int | float)}
    series: dict[str, list[dict]] = defaultdict(list)
    for e in run.events_of("task"):
        if e.get("step") in tokens and isinstance(e.get("acc"), int | float):
            series[str(e.get("task"))].append(e)
    if not series:
        return "no task rows (eval.tasks) at steps with a tokens count"
    for i, (name, rows) in enumerate(sorted(series.items())):
        color = f"C{i % 10}"  # matplotlib's colour cycle
        x = [tokens[r["step"]] for r in rows]
        ax.plot(x, [r["acc"] for r in rows], marker="o", ms=3, lw=1.2, color=color, label=f"{name} acc")
        if all(isinstance(r.get("acc_norm"), int | float) for r in rows):
            ax.plot(x, [r["acc_norm"] for r in rows], marker="s", ms=3, lw=1.0, ls="--", color=color, label=f"{name} acc_norm")
    ax.set(xlabel="tokens trained", ylabel="accuracy")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return None


def _expert_load(ax: Axes, run: Run) -> str | None:
    """Rows: each MoE layer's experts; columns: log intervals; colour: the expert's token
    slots over the layer's mean (1 = its fair share, 0 = idle)."""
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    series = moe_intervals(run)
    if not series:
        return "no interval events with an expert load (not a mixture of experts)"
    n_layers = min(len(e["moe"]["layers"]) for e in series)
    experts = len(series[-1]["moe"]["layers"][0]["load"])
    layers = list(range(n_layers))
    if n_layers * experts > MAX_ROWS:
        last = series[-1]["moe"]["layers"]
        layers = sorted(sorted(layers, key=lambda i: -(last[i].get("imbalance") or 0.0))[: max(1, MAX_ROWS // experts)])
        ax.set_title(f"the {len(layers)} most imbalanced of {n_layers} layers (last interval)", fontsize=9)
    per = math.ceil(len(series) * len(layers) * experts / MAX_CELLS)
    columns = [series[i : i + per] for i in range(0, len(series), per)]
    edges = [series[0]["step"] - (series[0].get("steps") or 1)] + [c[-1]["step"] for c in columns]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        edges = list(range(len(columns) + 1))  # steps out of order (hand-edited rows): columns by position
    grid = np.full((len(layers) * experts, len(columns)), np.nan)
    for c, column in enumerate(columns):
        for r, i in enumerate(layers):
            load = np.sum([e["moe"]["layers"][i]["load"] for e in column], axis=0, dtype=float)
            if load.sum() > 0:
                grid[r * experts : (r + 1) * experts, c] = load * experts / load.sum()
    # Blue: starved, white: fair, red: overloaded (up to experts / top_k, every token).
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(2.0, float(np.nanmax(grid))) if np.isfinite(grid).any() else 2.0)
    mesh = ax.pcolormesh(edges, np.arange(len(layers) * experts + 1), grid, cmap="RdBu_r", norm=norm, shading="flat")
    ax.grid(False)
    ax.invert_yaxis()
    for b in range(1, len(layers)):
        ax.axhline(b * experts, color="black", lw=0.8)
    ax.set_yticks([(r + 0.5) * experts for r in range(len(layers))], [f"layer {i}" for i in layers])
    ax.set(xlabel="step (log intervals)", ylabel=f"MoE layer: experts 0-{experts - 1} top down")
    fig = ax.get_figure(root=True)
    assert fig is not None  # _plot's Figure
    fig.colorbar(mesh, ax=ax, label="token slots / fair share")
    fig.set_size_inches(9, min(14.0, max(3.4, 1.2 + 0.09 * len(layers) * experts)))  # rows stay readable
    return None


PLOTS: tuple[tuple[str, str, Callable[[Axes, Run], str | None]], ...] = (
    ("plot-loss", "Loss per optimizer step, and per evaluation", _loss),
    ("plot-lr", "Learning rate per optimizer step, and each optimizer group's per log interval where they differ", _lr),
    ("plot-throughput", "Throughput per log interval", _throughput),
    ("plot-breakdown", "Step time by phase per rank (mean over log intervals after the first)", _breakdown),
    ("plot-memory", "Peak memory per rank", _memory),
)
TASK_PLOT: tuple[tuple[str, str, Callable[[Axes, Run], str | None]], ...] = (
    ("plot-tasks", "Downstream task accuracy (eval.tasks) against tokens trained", _tasks),
)
EXPERT_PLOT: tuple[tuple[str, str, Callable[[Axes, Run], str | None]], ...] = (
    ("plot-experts", "Expert load per MoE layer over the run (token slots over the fair share)", _expert_load),
)
