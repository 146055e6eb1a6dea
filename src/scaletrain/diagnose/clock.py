"""`scaletrain diagnose`: the planner's clock (planning/clock) beside the run's measured
phases, and the term that missed most.

The run is planned again from its config.yaml and run.json as it ran (its layout, world,
device): a GPU run on that GPU kind's rates (its table, or its datasheet's, as the plan
says), a CPU run on the rates of the CPU diagnosing it (measured here: another machine's
may differ). Telemetry measures data, forward, backward, optimizer and other; the exposed
communication, a pipeline's bubble and offload happen inside forward and backward there,
so they are compared together as the passes.
"""

from __future__ import annotations

import statistics
from typing import Any

from scaletrain.diagnose.run import Finding, Run, pct
from scaletrain.errors import UserError
from scaletrain.strategies import TABLE

MEASURED = ("data_s", "forward_s", "backward_s", "optimizer_s", "other_s")


def predicted_step(run: Run) -> Any:
    """The clock's StepTime for the run as it ran, or None (no config, an unknown engine, a
    layout or device the planner cannot take)."""
    from scaletrain.config.batch import settle
    from scaletrain.config.parallel import dims_for
    from scaletrain.planning import Setup, planning_spec
    from scaletrain.planning.clock.step import step_time
    from scaletrain.planning.hardware import gpu, gpu_kind, this_cpu

    cfg, info = run.config, run.info
    if cfg is None or run.engine not in TABLE or cfg.parallel.strategy == "auto":
        return None
    world = int(info.get("world_size") or 1)
    try:
        dims = dims_for(cfg.parallel, world)
        cfg = settle(cfg, dims.dp_size)
        if info.get("device") == "cuda":
            kind = gpu_kind(str(info.get("device_name") or ""))
            memory = info.get("device_memory_bytes")
            device = gpu(kind if kind in _known() else None, f"{int(memory)}B" if memory else None)
        else:
            device = this_cpu()
        nodes = max(1, len(set(info.get("hosts") or [None])))
        return step_time(planning_spec(cfg), Setup.from_config(cfg, dims), cfg, device, nodes)
    except UserError:
        return None


def _known() -> set[str]:
    from scaletrain.planning.hardware import KNOWN_GPUS

    return set(KNOWN_GPUS)


def clock(run: Run) -> list[Finding]:
    steady = [e for e in run.steady() if isinstance(e.get("phases"), dict) and e.get("step_s")]
    if not steady:
        return []
    t = predicted_step(run)
    if t is None:
        return []
    measured = {
        k: statistics.median(e["phases"][k] for e in steady if e["phases"].get(k) is not None)
        for k in MEASURED
        if any(e["phases"].get(k) is not None for e in steady)
    }
    step = statistics.median(e["step_s"] for e in steady)
    p = t.phases
    passes = p["forward"] + p["backward"] + p["comm"] + p["bubble"] + p["offload"]
    rows = [
        ("data", p["data"], measured.get("data_s")),
        ("forward and backward", passes, _sum(measured, "forward_s", "backward_s")),
        ("optimizer", p["optimizer"], measured.get("optimizer_s")),
        ("other", p["other"], measured.get("other_s")),
    ]
    evidence = [
        f"{name}: predicted {pred:.4g} s, measured {meas:.4g} s ({_error(pred, meas)})"
        for name, pred, meas in rows
        if meas is not None
    ]
    inside = {k: p[k] for k in ("comm", "bubble", "offload") if p[k]}
    if inside:
        evidence.append(
            "of the passes, predicted: "
            + ", ".join(f"{k} {v:.4g} s" for k, v in [("forward", p["forward"]), ("backward", p["backward"]), *inside.items()])
        )
    missed = max((r for r in rows if r[2] is not None), key=lambda r: abs(r[1] - r[2]))
    phase = "forward" if missed[0] == "forward and backward" else missed[0]
    items = t.largest.get(phase, ())[:2] + (t.largest.get("backward", ())[:1] if phase == "forward" else ())
    evidence.append(
        f"the term that missed most: {missed[0]} ({missed[1] - missed[2]:+.4g} s); its largest predicted items: "
        + ("; ".join(f"{label} {s:.4g} s" for label, s in items) or "none")
    )
    evidence.append(f"rates: {t.source}" + ("; " + "; ".join(t.notes) if t.notes else ""))
    title = f"predicted step {t.total:.4g} s against {step:.4g} s measured ({_error(t.total, step)}); the plan's clock, phase by phase"
    advice = "scaletrain plan CONFIG --explain-time prints the same prediction; scaletrain plan --calibrate measures this machine's rates"
    return [Finding("info", "clock", title, evidence, advice)]


def _sum(measured: dict[str, float], *keys: str) -> float | None:
    values = [measured.get(k) for k in keys]
    return None if any(v is None for v in values) else float(sum(v for v in values if v is not None))


def _error(predicted: float, measured: float) -> str:
    return "n/a" if measured <= 0 else f"{'+' if predicted >= measured else '-'}{pct(abs(predicted / measured - 1))}"
