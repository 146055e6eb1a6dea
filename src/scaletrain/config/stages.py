"""How a model is cut into pipeline stages, without torch: the schedules scaletrain offers,
their constraints, which stages a rank runs and where the cuts go. The engine
(engines/pipeline.py), the config's checks and the planner all read it.
"""

from __future__ import annotations

import math

from scaletrain.errors import UserError

# parallel.pp_schedule -> (torch's schedule class name, stages per rank, stage placement)
# "loop": rank r holds stages r, r + pp, ...; "v": rank r holds r and 2 pp - 1 - r (the
# V shape the zero-bubble V schedules need, so the last stage sits beside the first).
SCHEDULES: dict[str, tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", 2, "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}

# The zero-bubble schedules run each micro-batch's backward in two halves, the input's
# gradient first and the weights' later (torch's stage_backward_input / _weight), keeping the
# graph between them. A compiled block's backward is one AOTAutograd node, which computes both
# at once and frees its saved buffers when it runs (donated buffers): torch refuses the second
# half ("compiled with non-empty donated buffers which requires ... retain_graph=False").
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")


def compile_problem(schedule: str, pp: int) -> str | None:
    """Why train.compile cannot run with this pipeline (SPLIT_BACKWARD), or None."""
    if pp == 1 or schedule not in SPLIT_BACKWARD:
        return None
    offered = "|".join(s for s in SCHEDULES if s not in SPLIT_BACKWARD)
    return (
        f"train.compile=true does not combine with parallel.pp_schedule={schedule} (a zero-bubble schedule runs each "
        "backward in two halves, input's then weights', which a compiled block's one backward cannot); accepted: "
        f"parallel.pp_schedule={offered}, or train.compile=false"
    )


def schedule_problem(schedule: str, pp: int, micro_batches: int) -> str | None:
    """What torch's schedule would reject about `micro_batches` (train.grad_accum) on `pp`
    ranks, said up front (torch says it only once every rank has built its stages)."""
    stages = pp * SCHEDULES[schedule][1]
    if schedule == "1f1b" and micro_batches < pp:
        return f"1f1b needs at least parallel.pp={pp} micro-batches per step (train.grad_accum), got {micro_batches}"
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        rounds = max(1, micro_batches // pp)
        if micro_batches % rounds:
            ok = [m for m in range(1, 4 * pp + 1) if m % max(1, m // pp) == 0]
            return (
                f"{schedule} needs train.grad_accum to be a multiple of its rounds (grad_accum // pp); "
                f"{micro_batches} is not (accepted e.g. {', '.join(map(str, ok[:8]))})"
            )
    if schedule == "dualpipev" and micro_batches < stages:
        return f"dualpipev needs at least {stages} micro-batches per step (2 stages x pp {pp}), train.grad_accum={micro_batches}"
    return None


def stage_ids(schedule: str, pp: int, pp_rank: int) -> list[int]:
    """The stages `pp_rank` runs, in the order torch's schedules expect."""
    _, per_rank, style = SCHEDULES[schedule]
    if style == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def split_blocks(n_blocks: int, n_stages: int, block: float, first: float, last: float) -> list[range]:
    """Contiguous block ranges, one per stage, minimizing the costliest stage: every block
    costs `block`, the first stage also `first` (the embedding), the last `last` (final
    norm and head, which for a small model with a large vocabulary is worth several
    blocks). Each stage gets at least one block. Exact (dynamic programming over cuts)."""
    if n_blocks < n_stages:
        raise ValueError(f"{n_blocks} blocks cannot fill {n_stages} stages")

    def cost(start: int, end: int, stage: int) -> float:
        return (end - start) * block + (first if stage == 0 else 0.0) + (last if stage == n_stages - 1 else 0.0)

    # best[s][e]: the least possible max stage cost placing blocks [0, e) on stages [0, s).
    inf = math.inf
    best = [[inf] * (n_blocks + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_blocks + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for e in range(s, n_blocks - (n_stages - s) + 1):
            for b in range(s - 1, e):
                value = max(best[s - 1][b], cost(b, e, s - 1))
                if value < best[s][e]:  # strict: ties keep the earlier cut (more blocks later)
                    best[s][e], cut[s][e] = value, b
    bounds, e = [], n_blocks
    for s in range(n_stages, 0, -1):
        b = cut[s][e]
        bounds.append(range(b, e))
        e = b
    return bounds[::-1]


def check_stages(n_blocks: int, pp: int, schedule: str) -> None:
    """A one-line UserError unless every stage gets at least one block."""
    per_rank = SCHEDULES[schedule][1]
    if n_blocks < pp * per_rank:
        fits = [p for p in range(1, pp + 1) if n_blocks >= p * per_rank and p > 1]
        closest = f"parallel.pp={max(fits)}" if fits else "parallel.pp=1"
        single = " or parallel.pp_schedule=1f1b (one stage per rank)" if per_rank > 1 and n_blocks >= pp else ""
        raise UserError(
            f"parallel.pp={pp} with pp_schedule={schedule} makes {pp * per_rank} stages, but the model has only "
            f"{n_blocks} blocks (each stage needs one); closest valid layout: {closest}{single}"
        )


def ideal_bubble(pp: int, micro_batches: int, per_rank: int = 1) -> float:
    """The idle share of a step, (pp - 1) / (v m + pp - 1) for m micro-batches and v stages
    per rank, a micro-batch's forward and backward on a stage taken as one unit: exact for
    gpipe and 1f1b under that assumption, interleaving's smaller units included; the
    zero-bubble schedules fill part of it with weight gradients, so for them a bound."""
    return (pp - 1) / (per_rank * micro_batches + pp - 1)
