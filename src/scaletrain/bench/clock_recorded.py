"""The planner's clock against steps measured elsewhere: every GPU run recorded under
docs/gpu/ (`scaletrain bench --suite clock-gpu`) and published multi-GPU throughputs
(`--suite clock-published`, bench/published.py). Nothing runs: each is planned as its run
was configured, on its device, and the predicted step set beside the measured one. The
tables in docs/planner.md come from these.

A recorded run is a `scaletrain train` command of a results.jsonl row (the GPU checklist's,
scripts/gpu_checklist.py) with the measured step in its `data.step_s` (the median of its
log intervals after the first), on the device its folder's env.json names. It is planned
as `scaletrain plan --configured-only --device-defaults` plans it: with the defaults train
applied on that device to the keys the command left unset.
"""

from __future__ import annotations

import json
import shlex
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scaletrain.bench.published import Peaks

Say = Callable[[str], None]
# Keys of a run's command that do not change its step (where it writes, how long, what it logs).
_RUN_ONLY = ("run.dir=", "train.resume=", "checkpoint.every=", "telemetry.", "train.log_every=")


@dataclass(frozen=True)
class Recorded:
    source: str  # the results.jsonl it came from
    name: str
    device: str  # the GPU's name (env.json)
    memory: int  # its bytes
    overrides: tuple[str, ...]
    measured_s: float
    steps: int = 0  # the run's logged steps, where its row says (0: not said)


@dataclass(frozen=True)
class Compared:
    name: str
    where: str
    device: str
    measured_s: float
    predicted_s: float
    phases: dict[str, float]
    notes: tuple[str, ...]

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def recorded_runs(root: Path) -> list[Recorded]:
    """Every `scaletrain train` row with a measured step under `root` (docs/gpu)."""
    out = []
    for results in sorted(root.rglob("results.jsonl")):
        env_file = results.parent / "env.json"
        env = json.loads(env_file.read_text()) if env_file.is_file() else {}
        for line in results.read_text().splitlines():
            row = json.loads(line)
            data = row.get("data") or {}
            args = shlex.split(row.get("cmd", ""))
            if "train" not in args or not data.get("step_s") or data.get("device", "cuda") != "cuda":
                continue
            overrides = tuple(a for a in args[args.index("train") + 1 :] if not a.startswith(_RUN_ONLY))
            # The defaults the run applied, where its row records them (scripts/gpu_peers.py): the
            # run is planned as it ran, not as today's defaults would resolve its command.
            overrides += tuple(data.get("resolved") or ())
            device = env.get("device_name") or row.get("device_name") or "NVIDIA H100"
            memory = int(env.get("device_memory") or row.get("device_memory") or 80 * 2**30)
            out.append(
                Recorded(
                    str(results.relative_to(root)),
                    row["name"],
                    device,
                    memory,
                    overrides,
                    float(data["step_s"]),
                    int(data.get("steps") or 0),
                )
            )
    return out


def predict(
    overrides: tuple[str, ...], kind: str, memory: int, gpus_per_node: int = 1, nodes: int = 1, peaks: Peaks | None = None
) -> Any:
    """The chosen layout's StepTime as `scaletrain plan --configured-only --device-defaults`
    plans `overrides` on `gpus_per_node` x `nodes` GPUs of `kind`; `peaks`, where
    given, in place of the kind's datasheet peaks."""
    from dataclasses import replace

    from scaletrain.config import load_config
    from scaletrain.planning.hardware import gpu
    from scaletrain.training.preflight import plan_as_trained

    cfg = load_config([], list(overrides))
    device = gpu(kind, f"{memory}B")
    if peaks is not None:
        device = replace(device, peak_flops_16=peaks.bf16, peak_flops_8=peaks.float8, memory_bw=peaks.memory_bw)
    named = "strategy" in cfg.parallel.model_fields_set and cfg.parallel.strategy != "auto"
    plan, _, _ = plan_as_trained(cfg, device, gpus_per_node * nodes, nodes, None, 0.1, False, named, True)
    chosen = plan.chosen if plan.chosen.fits or plan.chosen.smaller is None else plan.chosen.smaller
    return chosen.time


# A run of this many steps or fewer has its step measured while it warms up: the median of its log
# intervals after the first (steps 2 and 3 of 3) still holds the allocator's growth and the first
# calls of cuBLAS, cuDNN and DeepSpeed, where the clock predicts a steady step.
WARMING_UP_STEPS = 3


def warming_up(run: Recorded) -> tuple[str, ...]:
    """The table's note for a run whose measured step is not a steady one, else nothing."""
    if 0 < run.steps <= WARMING_UP_STEPS:
        return (f"{run.name} ({run.source}): {run.steps} steps, measured while warming up (the median of steps 2-{run.steps})",)
    return ()


def compare_recorded(root: Path, say: Say) -> list[Compared]:
    from scaletrain.planning.hardware import gpu_kind

    out = []
    for run in recorded_runs(root):
        t = predict(run.overrides, gpu_kind(run.device), run.memory)
        c = Compared(run.name, run.source, run.device, run.measured_s, t.total, dict(t.phases), t.notes + warming_up(run))
        say(f"{run.source} {run.name}: measured {run.measured_s * 1e3:.1f} ms, predicted {t.total * 1e3:.1f} ms ({c.error:+.1%})")
        out.append(c)
    return out


def table(rows: list[Compared], measured_label: str = "measured") -> str:
    lines = [
        f"| run | where | device | {measured_label} | predicted | error | largest predicted phases |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.where} | {r.device} | {_seconds(r.measured_s)} | {_seconds(r.predicted_s)} | {r.error:+.1%} "
            f"| {largest_phases(r.phases, _seconds)} |"
        )
    errors = [abs(r.error) for r in rows]
    if errors:
        within = sum(e <= 0.15 for e in errors)
        lines += [
            "",
            f"{len(rows)} runs: median |error| {statistics.median(errors):.1%}, largest {max(errors):.1%}; {within} within 15%.",
        ]
    notes = sorted({n for r in rows for n in r.notes})
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines)


def largest_phases(phases: dict[str, float], fmt: Callable[[float], str], n: int = 3) -> str:
    """A prediction's `n` largest phases, "backward 1.2 s, forward ...", for a table's cell."""
    top = sorted(((k, v) for k, v in phases.items() if v > 0), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {fmt(v)}" for k, v in top)


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def write_between(docs: Path, marker: str, text: str) -> None:
    """`text` between `<!-- marker -->` and `<!-- /marker -->` in `docs`."""
    from scaletrain.errors import UserError

    begin, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    content = docs.read_text()
    if begin not in content or end not in content:
        raise UserError(f"--docs {docs}: it has no {begin} ... {end} markers to write the table between")
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    docs.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def compare_published(say: Say) -> list[Compared]:
    """Each published run (bench/published.py) planned on its GPUs (8 per node)."""
    from scaletrain.bench.published import PUBLISHED

    out = []
    for p in PUBLISHED:
        nodes = max(1, p.gpus // 8)
        t = predict(p.overrides, "h100", p.memory_gib * 2**30, gpus_per_node=min(8, p.gpus), nodes=nodes)
        notes = tuple(t.notes) + ((f"{p.name}: {p.differs}",) if p.differs else ())
        if p.lower is not None:  # the source's own lower bound of its GPU's peaks
            low = predict(p.overrides, "h100", p.memory_gib * 2**30, min(8, p.gpus), nodes, peaks=p.lower).total
            notes += (f"{p.name}: at {p.lower.said}: {_seconds(low)} ({low / p.step_s - 1:+.1%})",)
        c = Compared(p.name, p.source, f"{p.gpus} x H100", p.step_s, t.total, dict(t.phases), notes)
        say(f"{p.source} {p.name}: published {p.step_s:.3f} s/step, predicted {t.total:.3f} ({c.error:+.1%})")
        out.append(c)
    return out
