"""Long sequences in the plan: context parallel's two designs (all-gather, Ulysses), the
feed-forward in tiles (train.tile_tokens) and saved activations held on the host
(train.activation_offload): the layouts offered, their traffic and time, and the notes
that say what cp buys (docs/parallelism.md, docs/planner.md)."""

from __future__ import annotations

from dataclasses import replace

from scaletrain.models.spec import ModelSpec
from scaletrain.models.ulysses import heads_problem, kv_repeat
from scaletrain.planning.candidate import Candidate
from scaletrain.planning.hardware import fmt
from scaletrain.planning.memory import kv_width
from scaletrain.planning.pipeline import rank_share
from scaletrain.planning.setup import Setup

# From here on (Llama 3's long-context stage trains 32k-token sequences) the plan says what
# context parallel would save when activations are a large part of the peak.
LONG_SEQUENCE = 16384


def cp_options(mp: Setup, model: ModelSpec, world: int, nodes: int, tps: list[int]) -> list[Setup]:
    """Long sequences (LONG_SEQUENCE and more): cp 2, 4 or 8 (x each tp), cp x tp inside a
    node (each block's key/value gathers need NVLink), and Ulysses at the same sizes where
    each tp rank's heads divide over cp (a Hugging Face model: Ulysses only, where its spec
    takes the size); the global batch kept as for tp (dp / (cp x tp) ranks, each
    accumulating cp x tp times more)."""
    shape = getattr(model, "shape", None)
    # A Hugging Face model: Ulysses only, at the sizes its spec takes (models/hf.py).
    ulysses_problem = getattr(model, "ulysses_problem", None)
    if mp.seq_len < LONG_SEQUENCE or (shape is None and ulysses_problem is None):
        return []
    if getattr(shape, "capacity_factor", False):
        return []  # a capacity counts each rank's part of the sequences: refused (config/sequences.py)
    per_node = world // nodes
    out = []
    for cp in (2, 4, 8):
        for tp in tps:
            split = cp * tp
            if split > per_node or per_node % split or mp.dp % split:
                continue
            layout = replace(mp, cp=cp, tp=tp, dp=mp.dp // split, grad_accum=mp.grad_accum * split, sequence_parallel=True)
            if shape is not None and mp.seq_len % (2 * cp) == 0:
                out.append(replace(layout, cp_mode="allgather"))
            if shape is not None:
                heads = heads_problem(shape.n_heads, shape.n_kv_heads, cp, tp)
            else:
                assert ulysses_problem is not None  # checked on entry
                heads = ulysses_problem(cp)
            if mp.seq_len % cp == 0 and heads is None:
                out.append(replace(layout, cp_mode="ulysses"))
    return out


def cp_comm_bytes_per_step(model: ModelSpec, s: Setup) -> float:
    """Under cp, what each device receives per optimizer step for the attention, for every
    micro-batch and pass (forward, backward, and the forward again when activation
    checkpointing recomputes it). All-gather: each block gathers the other ranks' (cp - 1)/cp
    of the sequence's K and V, and reduce-scatters their gradients. Ulysses: q, k, v (the
    key/value heads repeated where fewer than cp) and the output, each (cp - 1)/cp of this
    rank's tensor through an all-to-all, the same bytes in backward."""
    if s.cp == 1:
        return 0.0
    act_bytes = 4.0 if s.precision == "fp32" else 2.0
    passes = 3 if s.activation_checkpointing else 2
    ring = (s.cp - 1) / s.cp
    if s.cp_mode == "ulysses":
        shape = getattr(model, "shape", None)
        # Under tp each rank exchanges its own heads only: 1/tp of the widths (its kv heads repeated as its attention does).
        kv = kv_width(model) * (kv_repeat(shape.n_kv_heads // s.tp, s.cp) if shape is not None else 1)
        per_pass = (2 * model.hidden_size + 2 * kv) / s.tp * s.micro_batch * s.local_seq_len * act_bytes * ring
    else:
        per_pass = 2.0 * s.micro_batch * s.seq_len * kv_width(model) / s.tp * act_bytes * ring
    return _rank_blocks(model, s) * s.grad_accum * passes * per_pass


def _rank_blocks(model: ModelSpec, s: Setup) -> int:
    return rank_share(model, s.pp, s.pp_schedule, s.seq_len)[1]


def what_cp_buys(chosen: Candidate, candidates: list[Candidate], seq_len: int) -> list[str]:
    """Long sequences, a plan without cp chosen: the best layout with cp, its peak and time,
    and so why it was not chosen (docs/parallelism.md). Activations and the logits scale
    with the tokens per rank; model states do not (FSDP shards them over dp x cp)."""
    if seq_len < LONG_SEQUENCE or chosen.setup.cp > 1:
        return []
    split = [c for c in candidates if c.setup.cp > 1]
    if not split:
        return []
    best = min(split, key=lambda c: (not c.fits, c.step_time))
    m, b = chosen.memory, best.memory
    if not best.fits:
        verdict = f"does not fit ({best.why_not})"
    elif best.step_time <= chosen.step_time * 1.02:
        verdict = "as fast within 2% (a tie goes to fewer moving parts)"
    else:
        verdict = "slower"
    return [
        f"sequences of {seq_len} tokens: context parallel, {best.setup.label}, needs {fmt(b.peak)} per device (activations "
        f"and logits {fmt(b.activations + b.loss)} against {fmt(m.activations + m.loss)}), estimated {best.step_time:.3g} "
        f"s/step with its attention traffic ({fmt(best.cp_comm_bytes)} per step): {verdict}, against {chosen.setup.label}"
    ]


def why_cp(chosen: Candidate, candidates: list[Candidate]) -> str:
    s = chosen.setup
    plain = [c for c in candidates if c.setup.cp == 1 and c.fits]
    other = min(plain, key=lambda c: c.step_time) if plain else None
    against = (
        f"; the fastest without it, {other.setup.label}, needs {fmt(other.memory.peak)}, estimated {other.step_time:.3g} s/step"
        if other
        else "; no layout without it fits"
    )
    traffic = (
        "swaps heads and positions by four all-to-alls around each attention"
        if s.cp_mode == "ulysses"
        else "all-gathers the keys and values"
    )
    return (
        f"cp={s.cp}: each rank holds {s.local_seq_len} of each sequence's {s.seq_len} tokens, so activations and logits "
        f"shrink {s.cp}x ({fmt(chosen.memory.activations + chosen.memory.loss)}); every block {traffic} over NVLink "
        f"({fmt(chosen.cp_comm_bytes)} per step){against}"
    )
