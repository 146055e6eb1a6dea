"""Replica groups (fault_tolerance, scaletrain/replica_groups.py) as diagnose reads them:
the quorum events in group 0's metrics (run.dir), and each other group's own metrics under
run.dir/replica_groups/group<g>/ with its quorum events (one process id per life) and its
rejoins (how long it waited, how much state it received)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scaletrain.diagnose.run import Finding, Run, gib
from scaletrain.telemetry.metrics import read_metrics

# A group that had to restart this often in one run is a bad node more likely than bad
# luck: failures at scale come about one every three hours over 16k GPUs (Llama 3's run),
# spread over every group; the same one twice in a short run points at its hardware.
FAILING_RESTARTS = 2


def group_events(root: Path) -> dict[int, list[dict[str, Any]]]:
    """The quorum and rejoin events of every group other than 0, by group."""
    out = {}
    for path in sorted((root / "replica_groups").glob("group*/metrics.jsonl")):
        number = path.parent.name.removeprefix("group")
        if number.isdigit():
            out[int(number)] = [r for r in read_metrics(path, events=True) if r.get("event") in ("quorum", "rejoin")]
    return out


def replica_groups(run: Run) -> list[Finding]:
    quorums = run.events_of("quorum")
    if not quorums:
        return []
    groups = group_events(run.root) | {0: quorums + run.events_of("rejoin")}
    configured = run.config.fault_tolerance.groups if run.config else max(groups) + 1
    short = [s for s in run.steps if isinstance(s.get("groups"), int) and s["groups"] < configured]
    findings = []
    for g, rows in sorted(groups.items()):
        lives = len({r["pid"] for r in rows if r.get("event") == "quorum" and "pid" in r})
        rejoins = [r for r in rows if r.get("event") == "rejoin"]
        if lives - 1 >= FAILING_RESTARTS:
            evidence = [
                f"rejoined at step {r.get('step')} after waiting {r.get('waited_s', 0):.1f} s for its quorum, "
                f"receiving {gib(r.get('received_bytes', 0))} from a peer"
                for r in rejoins[:5]
            ]
            findings.append(
                Finding(
                    "warning",
                    "replica_group_failing",
                    f"replica group {g} restarted {lives - 1} times",
                    evidence,
                    f"the other groups trained on without it, but each failure costs its restart and state transfer; "
                    f"look at group {g}'s output and hosts (a failing device or node) and replace them",
                )
            )
    changes = len({q.get("quorum_id") for q in quorums})
    facts = [
        f"{configured} replica groups; group 0 saw {changes} quorums",
        f"{len(short)} of {len(run.steps)} logged steps ran with fewer groups than {configured}",
    ]
    facts += [f"group {g}: {sum(r.get('event') == 'rejoin' for r in rows)} rejoins" for g, rows in sorted(groups.items())]
    findings.append(Finding("info", "replica_groups", "replica groups (fault_tolerance)", facts, ""))
    return findings
