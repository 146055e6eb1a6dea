"""What `scaletrain diagnose` concludes from a run directory: one small rule per problem.

Each rule takes the Run as read (scaletrain.diagnose.load_run) and returns findings; the
thresholds are named below with the reason for their value. A healthy run gets facts
(`summary`, `profile`) and no warning.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from scaletrain.diagnose.clock import clock
from scaletrain.diagnose.experts import router_collapse
from scaletrain.diagnose.groups import replica_groups
from scaletrain.diagnose.run import Finding, Run, gib, hours_unit, median_of, pct
from scaletrain.diagnose.spikes import spikes
from scaletrain.errors import UserError
from scaletrain.strategies import TABLE, Strategy

# Exposed communication (what overlap did not hide) above a quarter of the step: the
# devices then wait on the network one second in four, which batching or another layout
# usually wins back; below it, overlap is doing most of its job.
COMM_SHARE = 0.25
# Reading memory-mapped token shards costs microseconds per sample: a tenth of the step
# spent there means a slow disk or a starved host, not the loader's own work.
DATA_SHARE = 0.10
# The planner keeps 10% of the device free by default (plan --headroom): above 90% the
# allocator's fragmentation or one longer batch is enough for an out-of-memory error.
MEMORY_SHARE = 0.90
# Saves that stop training for over 5% of the wall time cost more than they protect at
# usual save intervals (the work lost to a crash is half an interval on average).
CHECKPOINT_SHARE = 0.05
TOP_OPS = 5
# A pipeline whose ranks idle over a fifth of each step: gpipe/1f1b reach that with fewer
# than 4 micro-batches per stage, (pp - 1) / (m + pp - 1) (torchtitan and Megatron advise
# m >= 4 pp); more micro-batches or an interleaved schedule win most of it back.
BUBBLE_SHARE = 0.20


def _span(intervals: list[dict[str, Any]]) -> str:
    return f"steps {intervals[0].get('step')}-{intervals[-1].get('step')}" if intervals else "no steps"


def phase_share(run: Run, phase: str) -> tuple[float, int] | None:
    """Median over the steady intervals of phases[phase] / step_s, and how many there were."""
    shares = [
        e["phases"][phase] / e["step_s"]
        for e in run.steady()
        if e.get("step_s") and isinstance(e.get("phases"), dict) and e["phases"].get(phase) is not None
    ]
    return (statistics.median(shares), len(shares)) if shares else None


# ---------------------------------------------------------------------------- warnings


def comm_bound(run: Run) -> list[Finding]:
    found = phase_share(run, "comm_s")
    if found is None or found[0] <= COMM_SHARE:
        return []
    share, n = found
    steady = run.steady()
    comm = statistics.median(e["phases"]["comm_s"] for e in steady if (e.get("phases") or {}).get("comm_s") is not None)
    step = median_of(steady, "step_s") or 0.0
    evidence = [
        f"median over {n} intervals ({_span(steady)}, the first left out as warm-up): "
        f"{comm:.3g} s of exposed communication in a {step:.3g} s step",
        f"engine {run.engine}, world {run.info.get('world_size', '?')}" + _batch(run),
    ]
    advice = (
        "raise train.grad_accum (each gradient sync then covers more compute) or train.micro_batch if memory allows; "
        + (TABLE[run.engine].comm_advice + "; " if run.engine in TABLE else "")
        + "or a faster interconnect (NVLink within a node, InfiniBand/RoCE between nodes)"
    )
    return [Finding("warning", "comm_bound", f"communication is {pct(share)} of step time", evidence, advice)]


def _batch(run: Run) -> str:
    t = run.config.train if run.config else None
    return f", micro-batch {t.micro_batch} x grad_accum {t.grad_accum}" if t else ""


def judged_steps(run: Run) -> set[int]:
    """The intervals whose stragglers count: after the warm-up one, and (when ranks.jsonl
    says which) only those where every rank's communication was sampled: the trainer
    judges busy time on the sampled step (docs/telemetry.md)."""
    steady = {e["step"] for e in run.steady()}
    if not any("sample" in r for r in run.ranks):
        return steady
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in run.ranks:
        by_step[r["step"]].append(r)
    return {s for s in steady if by_step.get(s) and all(r.get("sample") for r in by_step[s])}


def straggler(run: Run) -> list[Finding]:
    judged = judged_steps(run)
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in run.events_of("straggler"):
        if e.get("step") in judged:
            by_rank[int(e.get("rank", -1))].append(e)
    total = len(judged)
    found = []
    for rank, events in sorted(by_rank.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        # One flagged interval is an OS hiccup as often as a slow device: a straggler is
        # slow in most judged intervals (and in at least two).
        if len(events) < 2 or 2 * len(events) <= total:
            continue
        host = events[-1].get("host") or run.host(rank)
        excess = median_of(events, "excess") or 0.0
        steps = [e.get("step") for e in events]
        shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
        evidence = [
            f"flagged in {len(events)} of {total} judged intervals (at steps {shown}; sampled, after the warm-up)",
            f"median excess {pct(excess)}, worst {pct(max(e.get('excess', 0.0) for e in events))}; "
            f"its step {median_of(events, 'step_s') or 0:.3g} s vs the median rank's {median_of(events, 'median_s') or 0:.3g} s",
        ]
        others = sorted(r for r in by_rank if r != rank and (by_rank[r][-1].get("host") or run.host(r)) == host)
        if others:
            evidence.append(f"ranks {others} on the same host are flagged too: look at the host, not a single device")
        found.append(
            Finding(
                "warning",
                "straggler",
                f"rank {rank} (host {host}) is {pct(excess)} slower than the median in {len(events)} of {total} intervals",
                evidence,
                f"check host {host}: thermal or power throttling (nvidia-smi -q -d PERFORMANCE), other jobs on it, "
                "a slower or degraded GPU, data on a slow or network disk; every rank waits for it at each sync",
            )
        )
    return found


def memory_high(run: Run) -> list[Finding]:
    worst = max(
        (e for e in run.intervals if e.get("mem_peak_bytes") and e.get("mem_capacity_bytes")),
        key=lambda e: e["mem_peak_bytes"] / e["mem_capacity_bytes"],
        default=None,
    )
    if worst is None or worst["mem_peak_bytes"] / worst["mem_capacity_bytes"] <= MEMORY_SHARE:
        return []
    share = worst["mem_peak_bytes"] / worst["mem_capacity_bytes"]
    evidence = [
        f"peak {gib(worst['mem_peak_bytes'])} of {gib(worst['mem_capacity_bytes'])} in the interval ending at step {worst.get('step')}"
    ]
    top = max(run.ranks, key=lambda r: r.get("mem_peak_bytes") or 0, default=None)
    if top and top.get("mem_peak_bytes"):
        rank = int(top.get("rank", -1))
        evidence.append(f"largest on rank {rank} (host {top.get('host') or run.host(rank)}) at step {top.get('step')}")
    cfg = run.config
    saving = ac_saving(run)
    if saving is not None:
        frac, before, after = saving
        evidence.append(f"planner: {gib(before)} -> {gib(after)} per device with activation checkpointing")
        advice = (
            f"parallel.activation_checkpointing=true: activation checkpointing saves about {pct(frac)} of the peak (planner), "
            "for about a third more compute in backward"
        )
    else:
        # An unknown engine (an older run.json): what the most sharded, offloading strategy would try.
        less = TABLE[run.engine].less_memory if run.engine in TABLE else max(TABLE.values(), key=_sharding).less_memory
        advice = (
            f"a sharded strategy (parallel.strategy={less}) "
            "or a smaller train.micro_batch with a larger train.grad_accum (same global batch)"
        )
        if cfg is None:
            advice += "; parallel.activation_checkpointing=true if it is off (no readable config.yaml to check)"
    advice += "; `scaletrain plan` lists what fits"
    return [Finding("warning", "memory_high", f"memory peak {pct(share)} of the device", evidence, advice)]


def _sharding(row: Strategy) -> tuple[int, int]:
    return row.partitions, len(row.offload_optimizer) + len(row.offload_params)


def ac_saving(run: Run) -> tuple[float, float, float] | None:
    """(share of the peak saved, peak without, peak with) activation checkpointing, per the
    planner, for a run that had it off; None when it was on or the config is unknown."""
    from scaletrain.config.parallel import dims_for
    from scaletrain.planning import Setup, estimate, planning_spec

    cfg = run.config
    if cfg is None or cfg.parallel.activation_checkpointing or run.engine not in TABLE:
        return None
    try:
        dims = dims_for(cfg.parallel, int(run.info.get("world_size") or 1))
    except UserError:  # a layout this world cannot hold: a run.json that does not fit its config
        return None
    setup = Setup.from_config(cfg, dims)
    model = planning_spec(cfg)
    before = estimate(model, setup).peak
    after = estimate(model, replace(setup, activation_checkpointing=True)).peak
    return ((before - after) / before, before, after) if before > 0 else None


def replicas_disagree(run: Run) -> list[Finding]:
    events = run.events_of("replicas_disagree")
    if not events:
        return []
    first = min(int(e.get("step", 0)) for e in events)
    evidence = []
    for e in events[:5]:
        groups = e.get("groups") or []
        shown = " | ".join(str(sorted(g)) for g in groups)
        evidence.append(f"step {e.get('step')}: {e.get('what', 'weights')} hashes split the ranks into {shown}")
        if groups:
            odd = min(groups, key=len)
            evidence.append(f"  smallest group {sorted(odd)} on host(s) {', '.join(sorted({run.host(r) for r in odd}))}")
    if len(events) > 5:
        evidence.append(f"... and {len(events) - 5} more checks disagreed, the last at step {events[-1].get('step')}")
    saves = [int(c["step"]) for c in run.events_of("checkpoint") if int(c.get("step", 0)) < first]
    resume = f"resume from the checkpoint of step {max(saves)}, saved before it" if saves else "no checkpoint precedes it"
    advice = (
        "replicas (data-parallel ones, or the ranks of one tensor-parallel group for what they replicate) must hold "
        "identical weights after every step: suspect a rank that skipped or repeated "
        "an update, a non-deterministic op that breaks replication, or faulty device memory on the smallest group's host; "
        + resume
    )
    return [Finding("warning", "replicas_disagree", f"replicas disagree since step {first}", evidence, advice)]


def data_bound(run: Run) -> list[Finding]:
    found = phase_share(run, "data_s")
    if found is None or found[0] <= DATA_SHARE:
        return []
    share, n = found
    data = statistics.median(e["phases"]["data_s"] for e in run.steady() if (e.get("phases") or {}).get("data_s") is not None)
    return [
        Finding(
            "warning",
            "data_bound",
            f"data loading is {pct(share)} of the step",
            [f"median over {n} intervals ({_span(run.steady())}): {data:.3g} s per step waiting for the next batch"],
            "the loader reads memory-mapped token shards: keep the prepared dataset (data.dir) on a local SSD rather than "
            "a network filesystem, leave the host enough free RAM for the page cache, and check that no other process "
            "saturates the host's CPUs or disk",
        )
    ]


def pipeline_bubble(run: Run) -> list[Finding]:
    pipe = run.info.get("pipeline")
    if not pipe or pipe.get("bubble", 0) <= BUBBLE_SHARE:
        return []
    pp = run.info.get("parallel", {}).get("pp", len(pipe["stages"]))
    return [
        Finding(
            "warning",
            "pipeline_bubble",
            f"pipeline ranks idle {pct(pipe['bubble'])} of each step",
            [
                f"schedule {pipe['schedule']}, {len(pipe['stages'])} stages on pp {pp}, "
                f"{pipe['micro_batches']} micro-batches per step (train.grad_accum)"
            ],
            f"raise train.grad_accum (at least {4 * pp} micro-batches for pp {pp}; lower train.micro_batch to keep "
            "the global batch), or use parallel.pp_schedule=interleaved_1f1b or a zero-bubble schedule (zbv, interleaved_zb)",
        )
    ]


def hang(run: Run) -> list[Finding]:
    if run.hang is None:
        return []
    h = run.hang
    stuck = [int(r) for r in h.get("stuck_ranks") or []]
    steps = h.get("step") or []
    coll = h.get("collective") or {}
    evidence = [f"rank {r} (host {run.host(r)}): last step {steps[r] if r < len(steps) else '?'}" for r in stuck]
    if coll:
        evidence.append(
            f"collective {coll.get('name', '?')} #{coll.get('seq', '?')}: waiting ranks {coll.get('waiting_ranks', [])}, "
            f"missing ranks {coll.get('missing_ranks', [])}"
        )
    if steps:
        evidence.append("last step per rank: " + ", ".join(f"{r}:{s}" for r, s in enumerate(steps)))
    if h.get("timeout_s") is not None:
        evidence.append(f"no progress for {h['timeout_s']:g} s (guards.hang_timeout_s)")
    if not h:
        evidence.append("hang/hang.json is missing or unreadable; the per-rank dumps are there")
    look = ", ".join(f"hang/rank{r}.txt" for r in stuck[:4]) or "hang/rank<k>.txt"
    title = (
        f"the run hung: rank{'s' if len(stuck) != 1 else ''} {', '.join(map(str, stuck))} stopped" if stuck else "the run hung"
    )
    return [
        Finding(
            "warning",
            "hang",
            title,
            evidence,
            f"read the Python stacks in {look} for where the stuck ranks are; hang/fr_rank<k>.json holds each rank's "
            "recent collectives: ranks missing from a collective the others wait in took another code path, failed, "
            "or their host is unwell",
        )
    ]


def nonfinite(run: Run) -> list[Finding]:
    if not run.steps:
        return []
    last = run.steps[-1]
    n, rollbacks = int(last.get("nonfinite_steps") or 0), int(last.get("rollbacks") or 0)
    if n <= 0 and rollbacks <= 0:
        return []
    first = next((r["step"] for r in run.steps if (r.get("nonfinite_steps") or 0) > 0 or (r.get("rollbacks") or 0) > 0), None)
    evidence = [
        f"by step {last.get('step')}: non-finite steps (not applied) {n}, rollbacks {rollbacks}; the first at step {first}"
    ]
    advice = "a lower train.lr or a longer train.warmup_steps, train.clip_grad if it is 0"
    if run.info.get("precision") == "fp16":
        advice += ", bf16 instead of fp16 (its range does not overflow)"
    advice += f"; look at the data of the batches around step {first}"
    title = f"{n} non-finite step{'s' if n != 1 else ''}, {rollbacks} rollback{'s' if rollbacks != 1 else ''}"
    return [Finding("warning", "nonfinite", title, evidence, advice)]


def out_of_memory(run: Run) -> list[Finding]:
    """Out-of-memory errors the run survived (resilience/oom.py): each cost a restart from a checkpoint."""
    events = run.events_of("oom")
    if not events:
        return []
    evidence = [
        f"step {e.get('step')}: rank {e.get('rank')} (host {run.host(int(e.get('rank', 0)))}) in {e.get('phase')} at "
        f"micro-batch {e.get('micro_batch')} -> continued at {e.get('next_micro_batch')} x grad_accum "
        f"{e.get('next_grad_accum')} ({'inside the process' if e.get('path') == 'in-process' else 'every rank restarted'})"
        for e in events
    ]
    last = events[-1]
    n = len(events)
    return [
        Finding(
            "warning",
            "out_of_memory",
            f"{n} out-of-memory error{'s' if n != 1 else ''} survived: the run continues at micro-batch "
            f"{last.get('next_micro_batch')} (global batch {last.get('global_batch')} unchanged)",
            evidence,
            "the work since the checkpoint before each was done again; to avoid it, set train.micro_batch to "
            f"{last.get('next_micro_batch')} from the start (or train.micro_batch=auto with a larger `plan --headroom`), "
            "or free memory: parallel.activation_checkpointing=true, train.loss_chunk_tokens, a sharding strategy",
        )
    ]


def checkpoint_blocking(run: Run) -> list[Finding]:
    # The save at the last step stops nothing (the run is over) and no interval holds it.
    last = max((r["step"] for r in run.steps), default=0)
    saves = [e for e in run.events_of("checkpoint") if e.get("step", 0) < last]
    wall = sum(e.get("wall_s") or 0.0 for e in run.intervals)
    blocking = sum(e.get("blocking_s") or 0.0 for e in saves)
    if not saves or wall <= 0 or blocking / wall <= CHECKPOINT_SHARE:
        return []
    worst = max(saves, key=lambda e: e.get("blocking_s") or 0.0)
    waited = sum(e.get("waited_for_previous_s") or 0.0 for e in saves)
    evidence = [
        f"{len(saves)} saves stopped training for {blocking:.3g} s of {wall:.3g} s wall time "
        f"(the longest {worst.get('blocking_s', 0):.3g} s at step {worst.get('step')})"
    ]
    if waited:
        evidence.append(f"{waited:.3g} s of it waiting for the previous background save to finish")
    advice = []
    cfg = run.config
    if cfg is not None and not cfg.checkpoint.async_save:
        advice.append("checkpoint.async_save=true (training waits only for the copy to host memory)")
    every = f" (now {cfg.checkpoint.every})" if cfg else ""
    advice.append(f"fewer saves: a larger checkpoint.every{every}")
    advice.append("run.dir on a faster disk")
    return [
        Finding(
            "warning", "checkpoint_blocking", f"checkpoints block {pct(blocking / wall)} of the run", evidence, "; ".join(advice)
        )
    ]


# ---------------------------------------------------------------------------- facts


def profile(run: Run) -> list[Finding]:
    rank_of = lambda p: int(m.group(1)) if (m := re.search(r"rank(\d+)", p.name)) else 1 << 30
    traces = sorted((run.root / "profile").glob("*.trace.json"), key=lambda p: (rank_of(p), p.name))
    if not traces:
        return []
    advice = "open profile/rank<k>.trace.json in Perfetto or chrome://tracing for the timeline"
    try:
        from scaletrain.telemetry.profile import analyze_trace  # written beside this; optional until it lands
    except ImportError:
        return [Finding("info", "profile", f"{len(traces)} profiler traces, not analysed by this version", [], advice)]
    evidence, shares = [], []
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for path in traces:
        try:
            a = analyze_trace(path)
        except (OSError, ValueError) as e:
            evidence.append(f"{path.name}: unreadable ({e})")
            continue
        total = a.get("total_s") or 0.0
        if total > 0:
            shares.append(a.get("comm_s", 0.0) / total)
            evidence.append(
                f"{path.name.removesuffix('.trace.json')}: {total:.3g} s traced, communication {pct(a.get('comm_s', 0.0) / total)}, "
                f"computation {pct(a.get('compute_s', 0.0) / total)}"
            )
        if total > 0 and a.get("kernel_s"):  # a CUDA trace: what the device did in the steps (telemetry/profile.py)
            kinds = {**a["kernel_s"], "idle device": a.get("gpu_idle_s") or 0.0}
            by_share = sorted(((k, v / total) for k, v in kinds.items() if v), key=lambda kv: -kv[1])
            evidence.append(
                f"{path.name.removesuffix('.trace.json')} on the device: " + ", ".join(f"{k} {pct(v)}" for k, v in by_share)
            )
        for op in a.get("top_ops") or []:
            ops[op["name"]][0] += op.get("self_s", 0.0)
            ops[op["name"]][1] += op.get("count", 0)
    for name, (self_s, count) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:TOP_OPS]:
        evidence.append(f"top operator {name}: {self_s:.3g} s self time in {int(count)} calls (all ranks)")
    share = f": communication {pct(statistics.median(shares))} of traced time (median rank)" if shares else ""
    return [Finding("info", "profile", f"profile of {len(traces)} rank{'s' if len(traces) > 1 else ''}{share}", evidence, advice)]


def summary(run: Run) -> list[Finding]:
    info, last = run.info, (run.steps[-1] if run.steps else {})
    device = info.get("device_name") or info.get("device") or "?"
    evidence = [f"engine {run.engine}, world {info.get('world_size', '?')} x {device}, precision {info.get('precision', '?')}"]
    par, pipe = info.get("parallel") or {}, info.get("pipeline")
    split = [f"{n} {par[n]}" for n in ("tp", "pp", "cp") if par.get(n, 1) > 1]
    if split:
        evidence.append(f"model split over {', '.join(split)}; {par.get('dp_size', '?')} data-parallel ranks")
    if pipe:
        evidence.append(f"pipeline {pipe['schedule']}, {pipe['micro_batches']} micro-batches: bubble {pct(pipe['bubble'])}")
    evidence.append(f"{last.get('step') or 0} steps, {last.get('tokens') or 0:,} tokens")
    tps, mfu = median_of(run.intervals, "tokens_per_s"), median_of(run.intervals, "mfu")
    if tps is not None:
        evidence.append(f"{tps:,.0f} tokens/s (median of {len(run.intervals)} intervals)")
    if mfu is not None:
        evidence.append(f"MFU {100 * mfu:.1f}%")
    peak = max((e.get("mem_peak_bytes") or 0 for e in run.intervals), default=0)
    if peak:
        evidence.append(f"peak memory {gib(peak)} per device")
    end = run.intervals[-1] if run.intervals else {}
    if end.get("gpu_hours") is not None:
        cost = f", cost {end['cost']:,.2f}" if end.get("cost") is not None else ""
        evidence.append(f"{end['gpu_hours']:.3g} {hours_unit([info.get('device')])}{cost}")
    if last.get("loss") is not None:
        evidence.append(f"final loss {last['loss']:.4g}")
    title = f"{run.engine} x {info.get('world_size', '?')}, {info.get('precision', '?')}: {last.get('step', 0)} steps"
    if tps is not None:
        title += f", {tps:,.0f} tokens/s"
    return [Finding("info", "summary", title, evidence, "")]


RULES: tuple[Callable[[Run], list[Finding]], ...] = (
    hang,
    replicas_disagree,
    nonfinite,
    spikes,
    out_of_memory,
    memory_high,
    straggler,
    comm_bound,
    data_bound,
    pipeline_bubble,
    router_collapse,
    replica_groups,
    checkpoint_blocking,
    profile,
    clock,
    summary,
)


def diagnose_run(run: Run) -> list[Finding]:
    """Warnings first (most severe rules first), then the facts."""
    found = [f for rule in RULES for f in rule(run)]
    return [f for f in found if f.severity == "warning"] + [f for f in found if f.severity != "warning"]
