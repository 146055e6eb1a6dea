"""`scaletrain plan --longest-sequence`: for each way of holding a long sequence, the longest
one whose training step fits a device, with every term of its memory and its step time.

The layouts: the strategy the config names (else fsdp) with activation checkpointing, one
sequence per micro-batch, at cp 1 and at the largest cp of each design the world allows
(all-gather; Ulysses where the heads divide), each plain, with the feed-forward in tiles
(train.tile_tokens, TILE unless configured) and with tiles and the activations held on the
host (train.activation_offload: not on a CPU, whose host is its device). The chunked loss
(train.loss_chunk_tokens) is the configured one, or LOSS_CHUNK for a vocabulary that
needs it (training/defaults.py).

A mixture of experts: cp 1 also at the largest expert parallel it takes, and cp only at
that ep where there is one (planning/experts.py ep_sizes: FSDP then gathers E/ep of a
block's experts, not E; each rank's slots travel by all-to-all, as many as it sends, so its
activations stay). Under a capacity factor neither cp nor tiles (config/sequences.py
refuses both: a capacity counts a micro-batch's whole slots): activation offload alone. A
Hugging Face model: Ulysses only (at the sizes its spec takes), no tiles (the built-in
model's), activation offload alone; the longest is capped at its max_position_embeddings.

The search: the peak grows with the length (every term is constant or proportional to
the tokens a rank holds: a flash kernel saves a log-sum-exp per row, not the T x T
scores), so the longest length in steps of the layout's granule (GRANULE x what cp cuts
into) is found by doubling, then bisection, each step one estimate (planning/memory.py;
long blocks are traced short and extended, planning/activations.py). What stops it is
the moment of the peak there: the saved activations at backward's start (with the
loss's temporaries), or one block's recompute under checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scaletrain.config import Config
from scaletrain.config.parallel import dims_for
from scaletrain.models.spec import ModelSpec, with_fields
from scaletrain.models.ulysses import heads_problem
from scaletrain.planning.candidate import Candidate
from scaletrain.planning.experts import ep_sizes
from scaletrain.planning.hardware import Device, is_host
from scaletrain.planning.planner import evaluate
from scaletrain.planning.setup import Setup
from scaletrain.strategies import TABLE, names_where

GRANULE = 1024  # sequence lengths in steps of this (x 2 cp for the all-gather's chunks, x cp for Ulysses)
TILE = 8192  # positions per feed-forward tile where train.tile_tokens is unset
LOSS_CHUNK = 4096  # positions per loss chunk where train.loss_chunk_tokens is unset and the vocabulary is large
CHUNK_FROM_VOCAB = 65536  # training/defaults.py's threshold for chunking the loss
MAX_TOKENS = 1 << 25  # 33.5M tokens: the search stops there (fake-tensor traces grow with the length)


@dataclass(frozen=True)
class Longest:
    layout: str
    candidate: Candidate  # at the longest length that fits (fits False: not even one GRANULE)
    seq_len: int
    limit: str  # the moment of the peak at that length (planning/memory.py's phases): what stops it
    # What stops it before memory would: "positions" (a Hugging Face config's
    # max_position_embeddings: `train` refuses a longer data.seq_len), "search" (MAX_TOKENS),
    # or "" (memory).
    capped: str = ""


def longest_sequences(
    cfg: Config, model: ModelSpec, world: int, nodes: int, device: Device, usable: float, cpu_per_node: float | None
) -> list[Longest]:
    if not model.loss_chunk_tokens and model.vocab_size >= CHUNK_FROM_VOCAB:
        model = with_fields(model, loss_chunk_tokens=LOSS_CHUNK)
    named = "strategy" in cfg.parallel.model_fields_set and cfg.parallel.strategy != "auto"
    # Else the torch engine that shards everything and takes cp (fsdp): states sharded, what long sequences need most.
    strategy = cfg.parallel.strategy if named else names_where(lambda r: r.cp and r.partitions == 3 and not r.deepspeed_json)[0]
    base = replace(
        Setup.from_config(cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"strategy": strategy})}),
                          dims_for(cfg.parallel.model_copy(update={"strategy": strategy, "cp": 1, "tp": 1, "pp": 1}), world)),
        micro_batch=1, grad_accum=1, activation_checkpointing=True, tp=1, pp=1, cp=1, ep=1, tile_tokens=0,
        activation_offload=False,
    )  # fmt: skip
    tile = cfg.train.tile_tokens or TILE
    layouts = [base, *_with_ep(base, model)]
    shape = getattr(model, "shape", None)
    dropless = shape is not None and not (shape.experts and shape.capacity_factor)
    # A Hugging Face model: Ulysses only, where the spec takes the size (models/hf.py).
    ulysses_problem = getattr(model, "ulysses_problem", None)
    for mode in ("allgather", "ulysses") if dropless else ("ulysses",) if ulysses_problem else ():
        sizes = [c for c in _powers_of_two(world) if c > 1 and world % c == 0]
        if mode == "ulysses" and shape is not None:
            sizes = [c for c in sizes if heads_problem(shape.n_heads, shape.n_kv_heads, c) is None]
        elif mode == "ulysses" and ulysses_problem is not None:
            sizes = [c for c in sizes if ulysses_problem(c) is None]
        if sizes:
            cp = max(sizes)
            layout = replace(base, cp=cp, cp_mode=mode, dp=base.dp // cp)
            layouts += _with_ep(layout, model) or [layout]
    out = []
    for layout in layouts:
        tiled = replace(layout, tile_tokens=tile) if dropless else layout
        variants = [layout, tiled] if dropless else [layout]
        if not is_host(device):
            variants.append(replace(tiled, activation_offload=True))
        out += [_longest(model, s, cfg, device, nodes, usable, cpu_per_node) for s in variants]
    return out


def _longest(
    model: ModelSpec, s: Setup, cfg: Config, device: Device, nodes: int, usable: float, cpu_per_node: float | None
) -> Longest:
    step = GRANULE * (2 * s.cp if s.cp_mode == "allgather" and s.cp > 1 else s.cp)

    def at(tokens: int) -> Candidate:
        return evaluate(model, replace(s, seq_len=tokens), cfg, device, nodes, usable, cpu_per_node)

    positions = getattr(model, "max_positions", None)
    limit = min(MAX_TOKENS, positions or MAX_TOKENS)
    stop = "positions" if limit == positions else "search"
    most = max(1, limit // step)  # n x step: the lengths searched
    first = at(step)
    if not first.fits or step > limit:
        return Longest(first.setup.label, first, 0, first.memory.peak_phase, capped=stop if first.fits else "")
    # The largest n <= most with at(n x step) fitting: doubling, then halving the interval
    # (high: the least n known not to fit, or one past the most searched).
    low, high = 1, 2
    while high <= most and at(high * step).fits:
        low, high = high, 2 * high
    high = min(high, most + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if at(mid * step).fits else (low, mid)
    best = at(low * step)
    capped = stop if (low + 1) * step > limit else ""
    return Longest(best.setup.label, best, low * step, best.memory.peak_phase, capped=capped)


def _with_ep(layout: Setup, model: ModelSpec) -> list[Setup]:
    """The layout at the largest ep it takes (a mixture of experts on an engine with ep), or none."""
    sizes = ep_sizes(model, layout.shard, layout.cp) if TABLE[layout.strategy].ep else []
    return [replace(layout, ep=max(sizes))] if sizes else []


def _powers_of_two(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
