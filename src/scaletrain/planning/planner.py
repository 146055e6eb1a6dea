"""Which strategy fits, how fast each would be, and why one is chosen.

Step time = compute (FLOPs / (device peak x assumed MFU)) + the communication the
backward cannot hide + offload work. The assumptions are stated in docs/planner.md; the
point is a ranking between strategies on the same model, not a promise of wall time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import is_dataclass, replace
from typing import Any

from scaletrain.config import AUTO_MICRO_BATCH, Config
from scaletrain.config.batch import described, micro_batches, settle
from scaletrain.config.parallel import dims_for
from scaletrain.config.stages import compile_problem
from scaletrain.errors import UserError
from scaletrain.models.capabilities import TensorParallel, offered
from scaletrain.models.factory import distill_spec
from scaletrain.models.spec import ModelSpec, with_fields
from scaletrain.optim.registry import layout_problem, optimizer
from scaletrain.planning.candidate import Candidate, Plan
from scaletrain.planning.clock.step import step_time
from scaletrain.planning.context import cp_comm_bytes_per_step, cp_options, what_cp_buys, why_cp
from scaletrain.planning.expert_choice import why_ep
from scaletrain.planning.experts import (
    a2a_bytes_per_step,
    ep_options,
    experts_of,
    moe_note,
    moe_summary,
)
from scaletrain.planning.float8 import bf16_beside, check_device, plannable
from scaletrain.planning.hardware import Device, fmt, is_host
from scaletrain.planning.memory import estimate, groups_note
from scaletrain.planning.pipeline import pp_comm_bytes_per_step, pp_options, why_pp
from scaletrain.planning.setup import Setup
from scaletrain.planning.traffic import comm_bytes_per_step, tp_comm_bytes_per_step
from scaletrain.strategies import TABLE

# The chunk the plan suggests for a large loss: 4096 positions x a 128k vocabulary is 2 GiB
# of fp32 temporaries, small beside what it replaces, and few enough chunks to stay fast.
LOSS_CHUNK = 4096


def setups_for(cfg: Config, world: int, nodes: int, all_strategies: bool, model: ModelSpec | None = None) -> list[Setup]:
    """The configured strategy first, then (auto / planning) every strategy this world
    allows, with `model` also fsdp x tensor parallel layouts (a mixture of experts: fsdp x
    expert parallel layouts instead)."""
    p = cfg.parallel
    dims = dims_for(p, world)  # the one validation of the layout
    base = Setup.from_config(cfg, dims)
    distill = distill_spec(cfg, model) if model is not None else None
    if distill is not None:
        base = replace(base, teacher=distill.teacher)
    if not all_strategies:
        return [base]
    options = _data_parallel_options(base, world, nodes)
    moe = model is not None and experts_of(model) is not None
    if dims.tp == 1 and dims.pp == 1 and model is not None and distill is None:  # a teacher: data parallel only
        mp = replace(base, strategy=_MODEL_PARALLEL.name, **_PLAIN)
        tps = _tp_sizes(model, world, nodes)
        options += [replace(mp, tp=tp, dp=mp.dp // tp, grad_accum=mp.grad_accum * tp, sequence_parallel=True) for tp in tps]
        # A mixture of experts trains with tp, pp or cp, not two at once (the compositions
        # its tests check: docs/moe.md); ep then joins each (ep_options below).
        options += pp_options(mp, model, world, nodes, [1] if moe else [1, *tps])
        options += cp_options(mp, model, world, nodes, [1] if moe else [1, *tps])
    if moe and model is not None:
        # Expert parallel beside every layout that takes it: plain fsdp sharding, ep inside
        # each pipeline stage, over the data-parallel ranks of each tp coordinate.
        options += ep_options(options, model)
    # Activation checkpointing trades ~1/3 more compute for memory: a fallback option; selective
    # checkpointing (models/selective_ac.py) keeps more and repeats about half of that.
    if not base.activation_checkpointing:
        options += [replace(o, activation_checkpointing=True, selective=sel) for sel in (False, True) for o in options]
    # A configured tp or pp keeps only the strategies that compose with it.
    options = [o for o in options if (dims.tp == 1 or TABLE[o.strategy].tp) and (dims.pp == 1 or TABLE[o.strategy].pp)]
    options = [o for o in options if not base.float8 or plannable(o)]  # train.float8: where it runs
    options = [o for o in options if not cfg.train.compile or compiles(o)]  # train.compile: likewise
    options = [o for o in options if _optimizer_runs(o)]  # train.optimizer: likewise
    options = [o for o in options if not cfg.train.spikes.enabled or TABLE[o.strategy].holds_back]  # train.spikes
    if p.strategy == "auto":
        return options
    return [base, *(o for o in options if o != base)]


# Every candidate starts from the plain setup: no offload, weights resharded after forward,
# no hybrid sharding; the variants below add those back where a strategy takes them.
_PLAIN: dict[str, Any] = dict(offload_optimizer="none", offload_params="none", reshard_after_forward=True, dp_replicate=1, ep=1)
# In the order of fewer moving parts: _fastest settles ties by it.
_BY_COMPLEXITY = sorted(TABLE.values(), key=lambda r: r.complexity)
# The strategy tensor and pipeline parallel layouts are planned on.
_MODEL_PARALLEL = next(r for r in _BY_COMPLEXITY if r.tp and r.pp)


def compiles(s: Setup) -> bool:
    """Where train.compile runs (the config refuses the rest: the strategy's capability,
    config/stages.py's zero-bubble schedules, config/sequences.py's all-gather cp, whose mask
    does not trace, and config/schema.py's expert parallel, whose all-to-all reads its split
    sizes on the host)."""
    cp_traces = s.cp == 1 or s.cp_mode == "ulysses"
    return TABLE[s.strategy].compile and s.ep == 1 and compile_problem(s.pp_schedule, s.pp) is None and cp_traces


def _optimizer_runs(s: Setup) -> bool:
    """Where train.optimizer runs (config/schema.py refuses the rest): the strategies and
    layouts of its entry (optim/registry.py)."""
    entry = optimizer(s.optimizer)
    layout = {"cp": s.cp, "pp": s.pp, "tp": s.tp, "ep": s.ep, "dp_replicate": s.dp_replicate, "offload_params": s.offload_params}
    return s.strategy in entry.strategies and layout_problem(entry, layout) is None


def _data_parallel_options(base: Setup, world: int, nodes: int) -> list[Setup]:
    """Every strategy's plain setup and its variants (weights kept gathered, hybrid sharding
    over the nodes), then the offloading variants each strategy plans (the strategy table)."""
    options = []
    for row in _BY_COMPLEXITY:
        plain = replace(base, strategy=row.name, **_PLAIN)
        options.append(plain)
        if row.keeps_gathered:
            options.append(replace(plain, reshard_after_forward=False))
        if row.hybrid and nodes > 1 and world % nodes == 0:
            options.append(replace(plain, dp_replicate=nodes))
    for row in _BY_COMPLEXITY:
        options += [
            replace(base, strategy=row.name, **{**_PLAIN, "offload_optimizer": o, "offload_params": p})
            for o, p in row.planned_offloads
        ]
    return options


def _tp_sizes(model: ModelSpec, world: int, nodes: int) -> list[int]:
    """The tp sizes that fit inside a node and split the model evenly. Their layouts keep
    the global batch: with dp / tp data-parallel ranks, each accumulates tp times more
    micro-batches (the same micro-batch, so the same activation memory)."""
    per_node = world // nodes
    out = []
    for tp in (2, 4, 8):
        if tp > per_node or per_node % tp:
            continue
        plan = offered(model, TensorParallel)
        if plan is None:
            break  # a model of your own without a tensor-parallel plan (models/capabilities.py)
        try:
            plan.check_tp(tp)
        except UserError:
            continue
        out.append(tp)
    return out


def evaluate(
    model: ModelSpec,
    s: Setup,
    cfg: Config,
    device: Device,
    nodes: int,
    usable: float,
    cpu_per_node: float | None,
    timed: bool = True,
) -> Candidate:
    """The setup's memory, traffic and (`timed`) step time. Untimed, the step time is NaN:
    the clock traces a step and, on a CPU, replays its operations (seconds for a shape not
    seen before), which a run that only checks its configured layout's memory does not need."""
    if s.activation_offload and is_host(device):
        s = replace(s, activation_offload=False)  # a CPU's host memory is its device memory: nothing moves
    if s.float8 and is_host(device):
        s = replace(s, float8_gather=False)  # gloo carries no float8: FSDP gathers the weights in bf16 (engines/fsdp.py)
    mem = estimate(model, s)
    comm = comm_bytes_per_step(model, s, s.grad_accum)
    tp_comm = tp_comm_bytes_per_step(model, s, s.grad_accum)
    pp_comm = pp_comm_bytes_per_step(model, s)
    ep_comm = a2a_bytes_per_step(model, s)
    cp_comm = cp_comm_bytes_per_step(model, s)
    time = step_time(model, s, cfg, device, nodes) if timed else None
    comm += tp_comm + pp_comm + ep_comm + cp_comm
    why_not = ""
    if mem.peak > usable:
        why_not = f"needs {fmt(mem.peak)} per device > {fmt(usable)} usable"
    elif cpu_per_node is not None and mem.cpu * (s.reduce_ranks // nodes) > cpu_per_node:
        why_not = f"offload needs {fmt(mem.cpu * (s.reduce_ranks // nodes))} host memory per node > {fmt(cpu_per_node)}"
    return Candidate(
        s,
        mem,
        comm,
        time.total if time else math.nan,
        not why_not,
        why_not,
        tp_comm,
        pp_comm,
        ep_comm_bytes=ep_comm,
        cp_comm_bytes=cp_comm,
        time=time,
    )


def make_plan(
    cfg: Config,
    model: ModelSpec,
    world: int,
    nodes: int,
    device: Device,
    cpu_per_node: float | None = None,
    headroom: float = 0.1,
    all_strategies: bool = True,
    as_configured: bool = False,
    timed: bool = True,
) -> Plan:
    """Evaluate the configured setup (and, with all_strategies, every alternative).

    The fastest that fits is chosen, unless `as_configured` (a strategy the user named):
    then the configured setup is the plan, the alternatives shown beside it, and the
    planner's own pick named when it would be faster. Untimed (only `as_configured`): no
    step time anywhere, no comparison with the planner's pick."""
    if world < 1 or nodes < 1 or world % nodes:
        raise UserError(f"{world} devices cannot be split over {nodes} nodes; accepted: devices per node x nodes")
    usable = device.memory * (1 - headroom)
    if cfg.train.float8:
        check_device(device)
    cfg = settle(cfg, dims_for(cfg.parallel, world).dp_size)  # the global batch every layout keeps
    as_configured = as_configured and cfg.parallel.strategy != "auto"
    timed = timed or not as_configured
    judge = lambda s: evaluate(model, s, cfg, device, nodes, usable, cpu_per_node, timed)  # noqa: E731
    setups = setups_for(cfg, world, nodes, all_strategies, model)
    candidates = _micro_batch_search([judge(s) for s in setups], judge, cfg.train.micro_batch == AUTO_MICRO_BATCH)
    fitting = [c for c in candidates if c.fits]
    if not fitting and not (as_configured and all_strategies):
        raise UserError(_nothing_fits(model, cfg, candidates, device, nodes, world, usable, cpu_per_node))
    best = _fastest(fitting) if fitting and timed else None
    if as_configured:
        chosen = candidates[0]
        reasons = _as_configured(chosen, best, candidates)
    else:
        assert best is not None
        ep = [why_ep(model, best, candidates, world // nodes, judge)] if experts_of(model) is not None else []
        chosen, reasons = best, _reasons(best, candidates, ep)
    batch_choice = _why_micro_batch(chosen, cfg.train.micro_batch, cfg.train.global_batch or 0)
    plan = Plan(world, nodes, device, usable, candidates, chosen, reasons + batch_choice, 0)
    plan.batch_choice = batch_choice[0] if batch_choice else ""
    plan.max_micro_batch = largest_micro_batch(model, chosen.setup, usable)
    plan.notes += what_cp_buys(chosen, candidates, cfg.data.seq_len) if timed else []
    plan.notes += _what_chunking_buys(model, chosen)
    plan.notes += moe_note(model, cfg.data.seq_len) + groups_note(cfg.train)
    plan.moe = moe_summary(model, cfg.data.seq_len)
    if timed:
        float8_notes, plan.float8 = bf16_beside(chosen, judge, bool(cfg.train.compile))
        plan.notes += float8_notes
    return plan


def _micro_batch_search(candidates: list[Candidate], judge: Callable[[Setup], Candidate], auto: bool) -> list[Candidate]:
    """train.micro_batch=auto: each candidate at the largest micro-batch that fits it (at
    the smallest one when none does, the closest it comes). A number: a candidate that
    does not fit at it keeps its place, and the same setup at the largest smaller
    micro-batch that fits follows it. Always at the same global batch: grad_accum grows
    as the micro-batch shrinks, so what the run computes stays the same."""
    out = []
    for c in candidates:
        if c.fits and not auto:
            out.append(c)
            continue
        s = c.setup
        options = [b for b in micro_batches(s.micro_batch * s.grad_accum, s.pp, s.pp_schedule) if b <= s.micro_batch]
        found = _largest_fitting(s, options, judge)
        if auto:
            out.append(found or judge(at_micro_batch(s, options[-1])))
            continue
        c.smaller = found
        out += [c, found] if found else [c]
    return out


def at_micro_batch(s: Setup, micro_batch: int) -> Setup:
    """`s` at another micro-batch, each rank taking as many sequences per step as before."""
    return replace(s, micro_batch=micro_batch, grad_accum=s.micro_batch * s.grad_accum // micro_batch, searched=True)


def _largest_fitting(s: Setup, options: list[int], judge: Callable[[Setup], Candidate]) -> Candidate | None:
    """`s` at the largest of `options` (largest first) that fits: memory grows with the
    micro-batch, so a bisection finds it."""
    lo, hi, best = 0, len(options), None  # options[:lo] do not fit; the answer is in options[lo:hi]
    while lo < hi:
        mid = (lo + hi) // 2
        c = judge(at_micro_batch(s, options[mid]))
        if c.fits:
            best, hi = c, mid
        else:
            lo = mid + 1
    return best


def _why_micro_batch(chosen: Candidate, configured: int, global_batch: int) -> list[str]:
    s = chosen.setup
    at = described(s.micro_batch, s.grad_accum, global_batch)
    if configured == AUTO_MICRO_BATCH and chosen.fits:
        most = s.micro_batch * s.grad_accum
        why = "all of a rank's sequences in one micro-batch" if s.grad_accum == 1 else f"the largest of a rank's {most} that fits"
        return [f"train.micro_batch=auto -> {s.micro_batch}: {why} with {_without_micro_batch(s)}: {at}"]
    if chosen.smaller is not None:
        return [
            f"{_without_micro_batch(s)} fits with {described(chosen.smaller.setup.micro_batch, chosen.smaller.setup.grad_accum, global_batch)}, the same numbers (smaller micro-batches, more of them)"
        ]
    if s.searched and s.micro_batch < configured:
        return [
            f"nothing fits at train.micro_batch={configured}: {_without_micro_batch(s)} fits with {at}, the same numbers (smaller micro-batches, more of them)"
        ]
    return []


def _without_micro_batch(s: Setup) -> str:
    return replace(s, searched=False).label


def _what_chunking_buys(model: ModelSpec, chosen: Candidate) -> list[str]:
    """A plain loss that is a large part of the peak: what the chunked one would leave."""
    m = chosen.memory
    if model.loss_chunk_tokens or chosen.setup.tp > 1 or m.loss < 0.1 * m.peak or not is_dataclass(model):
        return []
    chunked = estimate(with_fields(model, loss_chunk_tokens=LOSS_CHUNK), chosen.setup)
    if chunked.loss >= 0.9 * m.loss:  # a rank's tokens fit in one chunk already (cp, small micro-batches)
        return []
    return [
        f"the loss holds {fmt(m.loss)} of the {fmt(m.peak)} peak (fp32 log-probabilities, gradient and temporary of "
        f"the logits); train.loss_chunk_tokens={LOSS_CHUNK} would hold {fmt(chunked.loss)} (peak {fmt(chunked.peak)})"
    ]


def _fastest(fitting: list[Candidate]) -> Candidate:
    # Estimates within 2% of the fastest are a tie, settled by preferring the engine with
    # fewer moving parts (the list order: ddp, zero1, zero2, fsdp, zero3, offload; AC last).
    fastest = min(c.step_time for c in fitting)
    return next(c for c in fitting if c.step_time <= fastest * 1.02)


def _as_configured(chosen: Candidate, best: Candidate | None, candidates: list[Candidate]) -> list[str]:
    text = f"{chosen.setup.label} as configured: needs {fmt(chosen.memory.peak)} per device"
    if chosen.time is not None:
        text += f", estimated {chosen.step_time:.3g} s/step"
    if not chosen.fits:
        text += f"; does not fit ({chosen.why_not})"
    reasons = [text]
    if best is not None and best is not chosen and best.step_time < chosen.step_time / 1.02:
        reasons.append(
            f"the planner's own choice would be {best.setup.label} (parallel.strategy=auto): " + _reasons(best, candidates)[-1]
        )
    return reasons


def largest_micro_batch(model: ModelSpec, s: Setup, usable: float, limit: int = 1 << 14) -> int:
    """Largest micro-batch whose peak still fits (0 if not even 1 does)."""
    fits = lambda b: estimate(model, replace(s, micro_batch=b)).peak <= usable  # noqa: E731
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _reasons(chosen: Candidate, candidates: list[Candidate], expert_reasons: list[str] | None = None) -> list[str]:
    reasons = []
    # The plain replicated candidate (ddp), against which the others' traffic is told.
    ddp = next((c for c in candidates if c.setup.label == c.setup.strategy and TABLE[c.setup.strategy].partitions == 0), None)
    for c in candidates:
        if c.step_time < chosen.step_time and not c.fits and not c.setup.activation_checkpointing:
            reasons.append(f"{c.setup.label} {c.why_not}")
    text = f"{chosen.setup.label} needs {fmt(chosen.memory.peak)} per device"
    if ddp is not None and chosen is not ddp and chosen.setup.dp > 1:
        more = chosen.comm_bytes / ddp.comm_bytes if ddp.comm_bytes else 1.0
        text += ", moves no more data than ddp" if more <= 1.0001 else f", moves {more:.1f}x the data of ddp"
    text += f", estimated {chosen.step_time:.3g} s/step: the fastest (or simplest of the equally fast) that fits: chosen"
    if chosen.setup.pp == 1 and (not_pp := _why_not_pp(chosen, candidates)):
        reasons.append(not_pp)
    if chosen.setup.tp > 1:
        reasons.append(_why_tp(chosen, candidates))
    if chosen.setup.cp > 1:
        reasons.append(why_cp(chosen, candidates))
    if chosen.setup.pp > 1:
        plain = [c for c in candidates if c.setup.pp == 1 and c.fits]
        other = min(plain, key=lambda c: c.step_time) if plain else None
        # A layout of one data-parallel rank moves no data-parallel bytes: no ratio to give.
        ratio = (other.dp_bytes / chosen.dp_bytes if chosen.dp_bytes > 0 else math.inf) if other else 0.0
        reasons.append(
            why_pp(chosen.step_time, chosen.setup, other.setup.label if other else None, other.step_time if other else 0, ratio)
        )
    reasons += expert_reasons or []  # a mixture of experts: why ep or not (expert_choice.py)
    reasons.append(text)
    return reasons


def _why_tp(chosen: Candidate, candidates: list[Candidate]) -> str:
    """Why tensor parallel: against the fastest plain data-parallel layout."""
    s = chosen.setup
    plain = [c for c in candidates if c.setup.tp == 1 and c.setup.pp == 1 and c.fits]
    text = f"tp={s.tp} inside each node (its per-block reductions need NVLink, not the network)"
    if not plain:
        return text + ": no layout without tensor parallel fits"
    other = min(plain, key=lambda c: c.step_time)
    mine = chosen.dp_bytes
    if mine <= 0:
        traffic = f"it needs no data-parallel traffic, where {other.setup.label} moves its states over {other.setup.dp} ranks"
    elif other.dp_bytes / mine >= 1.2:
        traffic = f"its data-parallel traffic over {s.dp} ranks is {other.dp_bytes / mine:.1f}x smaller than {other.setup.label}'s over {other.setup.dp}"
    else:  # the traffic is not what differs: say what is
        traffic = f"its data-parallel traffic over {s.dp} ranks is about {other.setup.label}'s over {other.setup.dp}{_slower_in(chosen, other)}"
    return (
        text + f": each rank holds 1/{s.tp} of the model, so {traffic}; "
        f"{chosen.step_time:.3g} s/step against {other.step_time:.3g} at the same global batch "
        f"(train.grad_accum x{s.tp * s.pp})"
    )


def _why_not_pp(chosen: Candidate, candidates: list[Candidate]) -> str:
    """Why no pipeline, where one fits: the fastest layout with one against the chosen, its
    bubble against the chosen's exposed communication (what a pipeline trades), or ''."""
    piped = [c for c in candidates if c.setup.pp > 1 and c.fits]
    if not piped:
        return ""
    best = min(piped, key=lambda c: c.step_time)
    text = (
        f"pipeline parallel not chosen: the fastest layout with it, {best.setup.label}, is estimated at "
        f"{best.step_time:.3g} s/step against {chosen.step_time:.3g}"
    )
    if best.time is None or chosen.time is None:
        return text
    return (
        text + f" (its bubble costs {best.time.phases.get('bubble', 0.0):.3g} s a step, where "
        f"{chosen.setup.label} leaves {chosen.time.phases.get('comm', 0.0):.3g} s of communication exposed)"
    )


def _slower_in(chosen: Candidate, other: Candidate) -> str:
    """', where OTHER spends N s more in PHASE': the clock's phase (--explain-time) where
    `other` loses the most against `chosen`, or '' where none is known."""
    if chosen.time is None or other.time is None:
        return ""
    mine, theirs = chosen.time.phases, other.time.phases
    more = {k: theirs.get(k, 0.0) - mine.get(k, 0.0) for k in {*mine, *theirs}}
    phase = max(more, key=lambda k: more[k], default=None)
    return f", where {other.setup.label} spends {more[phase]:.3g} s more in {phase}" if phase and more[phase] > 0 else ""


def _nothing_fits(
    model: ModelSpec,
    cfg: Config,
    candidates: list[Candidate],
    device: Device,
    nodes: int,
    world: int,
    usable: float,
    cpu_per_node: float | None,
) -> str:
    # The closest each comes: at the smallest micro-batch the global batch allows.
    candidates = [_at_smallest(c, model, cfg, device, nodes, usable, cpu_per_node) for c in candidates]
    best = min(candidates, key=lambda c: c.memory.peak)
    least = described(best.setup.micro_batch, best.setup.grad_accum, cfg.train.global_batch or 0)
    msg = (
        f"no strategy fits {world} x {fmt(device.memory)}, even at {least}: the smallest is "
        f"{_without_micro_batch(best.setup)} at {fmt(best.memory.peak)} per device"
    )
    if not best.why_not.startswith("needs"):
        msg += f" ({best.why_not})"
    # Grow the job node by node (same devices per node): the first size where anything fits.
    by_peak = sorted(candidates, key=lambda c: c.memory.peak)
    for more in (2, 4, 8, 16, 32, 64):
        for c in by_peak:
            probe = replace(c.setup, dp=world * more // (c.setup.tp * c.setup.pp), dp_replicate=1)
            if evaluate(model, probe, cfg, device, nodes * more, usable, cpu_per_node, timed=False).fits:
                return (
                    msg
                    + f"; closest feasible: {world * more} devices ({nodes * more} nodes) with {_without_micro_batch(probe)}, "
                    "or more memory per device"
                )
    return msg + "; try a smaller model, model.* overrides, or devices with more memory"


def _at_smallest(
    c: Candidate, model: ModelSpec, cfg: Config, device: Device, nodes: int, usable: float, cpu_per_node: float | None
) -> Candidate:
    s = c.setup
    smallest = micro_batches(s.micro_batch * s.grad_accum, s.pp, s.pp_schedule)[-1]
    if smallest == s.micro_batch:
        return c
    return evaluate(model, at_micro_batch(s, smallest), cfg, device, nodes, usable, cpu_per_node, timed=False)
