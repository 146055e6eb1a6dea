"""The planner's output for people (a rich table) and for programs (JSON)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from scaletrain.models.spec import ModelSpec
from scaletrain.planning.hardware import GiB
from scaletrain.planning.planner import Plan, fmt


def print_plan(console: Console, plan: Plan, model: ModelSpec, title: str) -> None:
    params = model.counts().total
    # A mixture of experts: the active count is what its FLOPs (and MFU) follow.
    active = f" ({plan.moe['active_params'] / 1e9:.3g}B active per token)" if plan.moe else ""
    console.print(
        f"[bold]{title}[/]: {params / 1e9:.3g}B parameters{active} | {plan.world} x {plan.device.name} "
        f"({plan.nodes} node{'s' if plan.nodes > 1 else ''}), {fmt(plan.device.memory)} each, "
        f"{fmt(plan.usable)} usable",
        highlight=False,
        soft_wrap=True,
    )
    # GiB per device in every memory column; bare numbers keep the table narrow.
    table = Table(
        show_lines=False,
        pad_edge=False,
        caption="memory in GiB per device; host = offloaded state (and swap buffers) per device, nvme = its swap files",
    )
    table.add_column("strategy", no_wrap=True)
    for col in ("params", "grads", "optim", "activ", "loss", "buffers", "peak", "host", "nvme", "comm/step", "s/step", "fits"):
        table.add_column(col, justify="right", no_wrap=True)
    for c in sorted(plan.candidates, key=lambda c: (not c.fits, c.step_time)):
        m = c.memory
        mark = "[green]yes[/]" if c.fits else "[red]no[/]"
        style = "bold" if c is plan.chosen else None
        table.add_row(
            c.setup.label,
            *(f"{gib(v):.1f}" for v in (m.params, m.grads, m.optimizer, m.activations, m.loss, m.buffers, m.peak)),
            f"{gib(m.cpu):.1f}" if m.cpu else "-",
            f"{gib(m.nvme):.1f}" if m.nvme else "-",
            f"{gib(c.comm_bytes):.1f}" if c.comm_bytes else "-",
            f"{c.step_time:.3g}",
            mark,
            style=style,
        )
    console.print(table)
    for reason in plan.reasons:
        console.print(f"  - {reason}", highlight=False, soft_wrap=True)
    console.print(
        f"  - largest micro-batch that fits with {plan.chosen.setup.label}: {plan.max_micro_batch}",
        highlight=False,
        soft_wrap=True,
    )
    for note in plan.notes:
        console.print(f"  - {note}", highlight=False, soft_wrap=True)


def print_measurement(console: Console, predicted: dict[str, Any], measured: dict[str, float]) -> None:
    """Predicted vs measured peak per component (activations and loss measured together)."""
    table = Table(title="predicted vs measured at the peak (this rank)")
    for col in ("component", "predicted", "measured", "error"):
        table.add_column(col, justify="left" if col == "component" else "right")
    rows = [
        ("params", predicted["params"], measured.get("params", 0.0)),
        ("optimizer", predicted["optimizer"], measured.get("optimizer", 0.0)),
        ("activations+loss", predicted["activations"] + predicted["loss"], measured.get("activations+loss", 0.0)),
        ("peak", predicted["peak"], measured["peak"]),
    ]
    if "cuda_max_allocated" in measured:
        rows.append(("peak (cuda max_allocated)", predicted["peak"], measured["cuda_max_allocated"]))
    for name, p, m in rows:
        err = f"{100 * (p / m - 1):+.1f}%" if m else "-"
        table.add_row(name, fmt(p), fmt(m), err)
    console.print(table)
    console.print(f"  predicted peak phase: {predicted['peak_phase']}", highlight=False)


def gib(nbytes: float) -> float:
    return round(nbytes / GiB, 3)
