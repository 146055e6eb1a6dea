"""`scaletrain diagnose`: what train.spikes decided (resilience/spikes.py's rows), each spike
with the documents its samples came from, so that the one that did it can be opened."""

from __future__ import annotations

from typing import Any

from scaletrain.diagnose.run import Finding, Run

SHOWN = 5  # spikes listed one by one; the rest counted


def _where(row: dict[str, Any]) -> str:
    origin = row.get("origin") or []
    named = sorted({f"{o['file']} (document {o['document']})" for o in origin if "file" in o})
    if named:
        return "; from " + ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
    shards = sorted({f"{o['shard']}@{o['offset']}" for o in origin if "shard" in o})
    if shards:
        return "; from " + ", ".join(shards[:3])
    samples = row.get("samples")
    return f"; samples {samples[0]}-{samples[1] - 1}" if samples else ""


def spikes(run: Run) -> list[Finding]:
    rows = run.events_of("spike")
    if not rows:
        return []
    judged = [r for r in rows if r.get("action") != "rolled back"]
    rollbacks = [r for r in rows if r.get("action") == "rolled back"]
    undone = [s for r in rollbacks for s in r.get("spikes") or []]
    every = sorted(judged + undone, key=lambda r: r["step"])
    held = sum("skipped" in str(r.get("action")) for r in every)
    evidence = [
        f"step {r['step']}: {r['metric'].replace('_', ' ')} {r['value']:.4g} above {r['threshold']:.4g} ({r['action']})"
        + _where(r)
        for r in every[:SHOWN]
    ]
    if len(every) > SHOWN:
        evidence.append(f"and {len(every) - SHOWN} more (metrics.jsonl's spike rows)")
    evidence += [f"rolled back to step {r['step']}, the data up to sample {r['data_skipped_to']} skipped" for r in rollbacks]
    title = (
        f"{len(every)} loss or gradient-norm spike{'s' * (len(every) != 1)}: {held} update{'s' * (held != 1)} held back, "
        f"{len(rollbacks)} rollback{'s' * (len(rollbacks) != 1)}"
    )
    advice = (
        "open the documents named (a run of one token, text of another kind than the rest); many spikes across "
        "documents point at the run instead: a lower train.lr, a longer train.warmup_steps"
    )
    return [Finding("warning", "spikes", title, evidence, advice)]
