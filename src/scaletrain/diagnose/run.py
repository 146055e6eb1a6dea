"""A run directory as the rules read it (Run, load_run) and what is said about it (Finding).

Only files are read (docs/telemetry.md), never a process group, so a run can be diagnosed
anywhere, during or long after it; missing fields are tolerated (a run that died early,
or one written by an older scaletrain, still gets what it has).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from scaletrain.errors import UserError
from scaletrain.telemetry.metrics import read_metrics

if TYPE_CHECKING:
    from scaletrain.config import Config

GiB = 1024**3

Severity = Literal["warning", "info"]


@dataclass(frozen=True)
class Finding:
    severity: Severity  # warning: something to act on; info: a fact about the run
    code: str  # stable: tests, --json consumers and report.html's data-code use it
    title: str
    evidence: list[str]
    advice: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Run:
    """Everything a run directory holds that the rules read."""

    root: Path
    info: dict[str, Any]  # run.json
    steps: list[dict[str, Any]]  # metrics.jsonl step rows
    events: list[dict[str, Any]]  # metrics.jsonl event rows
    ranks: list[dict[str, Any]]  # ranks.jsonl
    hang: dict[str, Any] | None  # hang/hang.json ({} when only the per-rank dumps exist)
    config: Config | None  # config.yaml, None when absent or not readable by this version

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    @property
    def intervals(self) -> list[dict[str, Any]]:
        return self.events_of("interval")

    def steady(self) -> list[dict[str, Any]]:
        """Intervals after the first, which holds start-up (allocator, kernels, compilation)."""
        iv = self.intervals
        return iv[1:] if len(iv) > 1 else iv

    def host(self, rank: int) -> str:
        hosts = self.info.get("hosts") or []
        return str(hosts[rank]) if 0 <= rank < len(hosts) else "?"

    @property
    def engine(self) -> str:
        return str(self.info.get("engine") or (self.config.parallel.strategy if self.config else "?"))


def load_run(run_dir: str | Path) -> Run:
    root = Path(run_dir)
    accepted = "accepted: a run directory (run.dir) written by `scaletrain train`, holding run.json"
    if not root.is_dir():
        raise UserError(f"{run_dir} is not a directory; {accepted}")
    # metrics.jsonl may not exist yet: a run that hung or crashed before its first log
    # interval still has run.json, and perhaps hang/, to diagnose.
    if not (root / "run.json").is_file():
        raise UserError(f"{run_dir} is not a run directory: no run.json; {accepted}")
    try:
        info = json.loads((root / "run.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{root / 'run.json'} is not valid JSON ({e}); {accepted}") from None
    rows = _jsonl(root / "metrics.jsonl")
    hang: dict[str, Any] | None = None
    if (root / "hang" / "hang.json").is_file():
        try:
            summary = json.loads((root / "hang" / "hang.json").read_text())
        except json.JSONDecodeError:
            summary = None
        hang = summary if isinstance(summary, dict) else {}
    elif any((root / "hang").glob("rank*.txt")):
        hang = {}  # rank 0 died before writing its summary: the dumps still say it hung
    return Run(
        root=root,
        info=info if isinstance(info, dict) else {},
        steps=[r for r in rows if "event" not in r and "step" in r],
        events=[r for r in rows if "event" in r],
        ranks=_jsonl(root / "ranks.jsonl"),
        hang=hang,
        config=_config(root / "config.yaml"),
    )


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """Every row (step and event) of a metrics-style file; none when it is absent."""
    return read_metrics(path, events=True) if path.is_file() else []


def _config(path: Path) -> Config | None:
    from scaletrain.config import load_config

    if not path.is_file():
        return None
    try:
        return load_config([str(path)])
    except UserError:
        return None  # written by another version: rules fall back to run.json


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB / 10 else f"{nbytes / 2**20:.1f} MiB"


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    return _median([r[key] for r in rows if isinstance(r.get(key), int | float)])


def hours_unit(devices: list[str | None]) -> str:
    """What the `gpu_hours` of runs on `devices` (run.json's device type) count: ranks x
    wall time, so GPU-hours only where every run had GPUs, CPU-hours where every one ran on
    CPUs (a rank per process there, whatever its cores), device-hours otherwise."""
    kinds = set(devices)
    if kinds == {"cuda"}:
        return "GPU-hours"
    return "CPU-hours" if kinds == {"cpu"} else "device-hours"
