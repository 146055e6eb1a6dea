"""What pipeline parallelism changes in a plan: each rank holds its stages' parameters
only, keeps several micro-batches' activations in flight, sends activations (not weights)
to its neighbours, and idles for the bubble. The cut is the engine's own (scaletrain.config.stages).

Pure arithmetic, like the rest of the planner. With a pipeline, FSDP keeps each stage's
parameters gathered for the whole step (engines/fsdp.py, as torchtitan does): one
all-gather per step instead of one or two per micro-batch.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from scaletrain.config.stages import SCHEDULES, ideal_bubble, schedule_problem, split_blocks, stage_ids
from scaletrain.errors import UserError
from scaletrain.models.capabilities import PipelineStages, capability, offered
from scaletrain.models.spec import ModelSpec
from scaletrain.planning.setup import Setup

# The schedules the planner weighs: the plain one and the interleaved one (half the
# bubble for more activations in flight). The zero-bubble ones need a measured split of
# backward into input and weight gradients to be estimated honestly; users can name them.
PLANNED_SCHEDULES = ("1f1b", "interleaved_1f1b")


@lru_cache(maxsize=256)
def rank_share(model: ModelSpec, pp: int, schedule: str, seq_len: int) -> tuple[int, int]:
    """(parameters, blocks) of the rank holding the most parameters, with the engine's cut."""
    c = model.counts()
    if pp == 1:
        return c.total, model.n_blocks
    n_stages = pp * SCHEDULES[schedule][1]
    first, block, last = capability(model, PipelineStages, f"parallel.pp={pp}", "parallel.pp=1").stage_costs(seq_len)
    ranges = split_blocks(model.n_blocks, n_stages, block, first, last)
    head = c.total - c.embedding - model.n_blocks * c.block  # final norm and an untied head

    def params(i: int) -> int:
        return len(ranges[i]) * c.block + (c.embedding if i == 0 else 0) + (head if i == n_stages - 1 else 0)

    shares = [
        (sum(params(i) for i in ids), sum(len(ranges[i]) for i in ids)) for ids in (stage_ids(schedule, pp, r) for r in range(pp))
    ]
    return max(shares)


def in_flight(s: Setup) -> float:
    """Micro-batches whose activations the first rank holds at once (in units of all its
    blocks' activations for one micro-batch): gpipe and looped BFS run every forward
    before any backward; 1F1B's warm-up holds pp; interleaving adds (pp - 1) / (pp v)
    of that (Megatron's accounting, arXiv 2104.04473)."""
    if s.pp == 1:
        return 1.0
    m = s.grad_accum
    if s.pp_schedule in ("gpipe", "looped_bfs"):
        return float(m)
    v = SCHEDULES[s.pp_schedule][1]
    return min(m, s.pp) * (1 + (s.pp - 1) / (s.pp * v) if v > 1 else 1.0)


def bubble(s: Setup) -> float:
    return ideal_bubble(s.pp, s.grad_accum, SCHEDULES[s.pp_schedule][1]) if s.pp > 1 else 0.0


def pp_comm_bytes_per_step(model: ModelSpec, s: Setup) -> float:
    """Each rank sends its stages' outputs forward and their input gradients backward, per
    micro-batch: 2 x v x m buffers of [micro_batch, seq, hidden] (split by tp under
    sequence parallel)."""
    if s.pp == 1:
        return 0.0
    act_bytes = 4 if s.precision == "fp32" else 2
    buffer = s.micro_batch * s.seq_len * model.hidden_size * act_bytes / (s.tp if s.sequence_parallel else 1)
    return 2 * SCHEDULES[s.pp_schedule][1] * s.grad_accum * buffer


def pp_options(fsdp: Setup, model: ModelSpec, world: int, nodes: int, tps: list[int]) -> list[Setup]:
    """fsdp x tp x pp for each tp in `tps` and pp a power of two the world and the model
    allow, the global batch kept (fewer data-parallel ranks accumulate more micro-batches)."""
    stages = offered(model, PipelineStages)
    if stages is None:
        return []  # a model of your own without stages (models/capabilities.py)
    try:
        stages.check_pp(2)
    except UserError:
        return []  # tied embeddings
    out = []
    for tp in tps:
        for pp in (2, 4, 8, 16, 32, 64):
            if world % (tp * pp) or tp * pp > world:
                continue
            for schedule in PLANNED_SCHEDULES:
                grad_accum = fsdp.grad_accum * tp * pp
                if model.n_blocks < pp * SCHEDULES[schedule][1] or schedule_problem(schedule, pp, grad_accum):
                    continue
                out.append(
                    replace(
                        fsdp,
                        tp=tp,
                        pp=pp,
                        pp_schedule=schedule,
                        dp=world // (tp * pp),
                        grad_accum=grad_accum,
                        sequence_parallel=True,
                        reshard_after_forward=False,
                    )
                )
    return out


def why_pp(chosen_time: float, s: Setup, other_label: str | None, other_time: float, traffic_ratio: float) -> str:
    text = (
        f"pp={s.pp} ({s.pp_schedule}): each rank holds about 1/{s.pp} of the blocks and keeps them gathered for the "
        f"step, so between ranks flow activations and one gather of its stage instead of the whole model's weights "
        f"per micro-batch; the bubble costs {bubble(s):.0%} at {s.grad_accum} micro-batches per step"
    )
    if other_label is None:
        return text + "; no layout without pipeline parallel fits"
    if traffic_ratio == float("inf"):  # one data-parallel rank: no such traffic at all
        traffic = "with data-parallel traffic this layout has none of (one data-parallel rank)"
    elif traffic_ratio >= 1:
        traffic = f"whose data-parallel traffic is {traffic_ratio:.0f}x this layout's"
    else:
        traffic = "whose data-parallel traffic is smaller but paid per micro-batch"
    return text + f"; {chosen_time:.3g} s/step against {other_time:.3g} for {other_label}, {traffic}"


def gathered_stage_bytes(params: int, precision: str) -> float:
    """FSDP's gathered copy of a rank's stages, held through the step (pipeline only)."""
    return float(params * (4 if precision == "fp32" else 2))
