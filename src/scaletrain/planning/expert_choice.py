"""Why `strategy: auto` chose expert parallel for a mixture of experts, or why not: the
reason planner.py adds beside the tp and pp ones (the arithmetic is experts.py's)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from scaletrain.config.batch import micro_batches
from scaletrain.models.spec import ModelSpec
from scaletrain.planning.candidate import Candidate
from scaletrain.planning.experts import Experts, experts_of, off_node_share
from scaletrain.planning.hardware import fmt
from scaletrain.planning.setup import Setup
from scaletrain.strategies import TABLE


def why_ep(
    model: ModelSpec, chosen: Candidate, candidates: list[Candidate], per_node: int, judge: Callable[[Setup], Candidate]
) -> str:
    """Why expert parallel was chosen, or why not (a mixture of experts only); `judge`
    estimates a setup (planner.evaluate) for the chosen layout without ep."""
    e = experts_of(model)
    assert e is not None
    s = chosen.setup
    if s.ep > 1:
        return _why_chosen(e, chosen, candidates, per_node, judge(replace(s, ep=1)))
    with_ep = [c for c in candidates if c.setup.ep > 1]
    if not with_ep:
        return f"expert parallel not weighed: no ep > 1 divides both the data-parallel size ({s.dp}) and the {e.experts} experts"
    fitting = [c for c in with_ep if c.fits]
    if not fitting:
        least = _at_smallest(min(with_ep, key=lambda c: c.memory.peak).setup, judge)
        said = f"expert parallel not chosen: no layout with it fits (the smallest, {least.setup.label}, {least.why_not})"
        return said + _with_offload(least.setup, judge)
    best = min(fitting, key=lambda c: c.step_time)
    return (
        f"expert parallel not chosen: the fastest layout with it, {best.setup.label}, is estimated at "
        f"{best.step_time:.3g} s/step against {chosen.step_time:.3g} (its all-to-all of the routed tokens, "
        f"{fmt(best.ep_comm_bytes)} per step, is all exposed)"
    )


def _why_chosen(e: Experts, chosen: Candidate, candidates: list[Candidate], per_node: int, same: Candidate) -> str:
    s = chosen.setup
    weight = 4 if s.precision == "fp32" else 2  # FSDP's gathered dtype
    link = "over NVLink inside a node" if off_node_share(s.ep, per_node) == 0 else "partly across nodes"
    text = (
        f"ep={s.ep}: each rank holds {e.experts // s.ep} of each MoE layer's {e.experts} experts, so FSDP gathers "
        f"{fmt(e.per_layer // s.ep * weight)} of expert weights per block instead of {fmt(e.per_layer * weight)}, over "
        f"{s.shard // s.ep} ranks instead of {s.shard}; the routed tokens cross by all-to-all, "
        f"{fmt(chosen.ep_comm_bytes)} per step {link}"
    )
    # The same layout without ep: what the experts' gathers cost it.
    text += (
        f"; without ep, {same.setup.label} moves {fmt(same.dp_bytes)} per step over the data-parallel ranks "
        f"against {fmt(chosen.dp_bytes)}, " + (f"estimated {same.step_time:.3g} s/step" if same.fits else f"and {same.why_not}")
    )
    plain = [c for c in candidates if c.setup.ep == 1 and c.fits]
    if not plain:
        return text + "; no layout without expert parallel fits"
    other = min(plain, key=lambda c: c.step_time)
    return text + (
        f"; {chosen.step_time:.3g} s/step against {other.step_time:.3g} for {other.setup.label}, the fastest "
        "without expert parallel"
    )


def _with_offload(s: Setup, judge: Callable[[Setup], Candidate]) -> str:
    """What the layout would need with its parameters on the host, where its strategy takes
    that with ep: the planner's candidates leave fsdp's offload out (strategies.py plans
    none), so a configured one is the user's call."""
    if s.offload_params != "none" or not TABLE[s.strategy].accepts_offload("none", "cpu"):
        return ""
    off = judge(replace(s, offload_params="cpu"))
    if not off.fits:
        return ""
    return (
        f"; with the parameters on the host it fits: {off.setup.label} needs {fmt(off.memory.peak)} per device, "
        f"estimated {off.step_time:.3g} s/step (parallel.offload_params=cpu parallel.ep={s.ep}, "
        f"train.micro_batch={s.micro_batch})"
    )


def _at_smallest(s: Setup, judge: Callable[[Setup], Candidate]) -> Candidate:
    """`s` at the smallest micro-batch its share of the global batch allows: the closest it comes."""
    smallest = micro_batches(s.micro_batch * s.grad_accum, s.pp, s.pp_schedule)[-1]
    return judge(replace(s, micro_batch=smallest, grad_accum=s.micro_batch * s.grad_accum // smallest, searched=True))
