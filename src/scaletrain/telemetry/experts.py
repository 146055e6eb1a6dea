"""Expert load per log interval: what each mixture-of-experts router did, on every rank.

The model sums its routing statistics per MoE layer on the device, forward after forward
(models/moe.py: token slots routed to each expert, dropped slots, the weighted auxiliary
loss, tokens seen). Each rank takes them once per interval, at the metrics flush (no host
sync per step), and sends them in the flush's one all_gather_object; this turns every
rank's sums into the interval event's "moe" field (docs/telemetry.md):

    {"tokens": tokens routed (all ranks), "aux": the layers' auxiliary losses summed, per
     micro-batch forward (what the objective adds to the cross entropy, which the `loss`
     rows are), "layers": [{"load": [slots per expert], "imbalance": max / mean load,
     "aux": the layer's weighted auxiliary loss per micro-batch forward, "balance" and
     "z": its two terms unweighted, "dropped": slots dropped by the capacity (0 when
     dropless)}, ...]}

Every rank counts the routing decisions of its own tokens (under expert parallelism too:
where a slot is computed does not matter), so the interval's load is the sum over ranks.
That holds while no two ranks see the same tokens, which is why a mixture of experts
trains without tensor or pipeline parallelism for now (config/schema.py): tensor-parallel ranks
would count their group's tokens once each.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scaletrain.models.moe import EXTRA_STATS, STAT_AUX, STAT_BALANCE, STAT_DROPPED, STAT_TOKENS, STAT_Z


def expert_load(per_rank: list[Any], forwards: int) -> dict[str, Any] | None:
    """The interval's "moe" field from each rank's statistics ([MoE layers, experts +
    EXTRA_STATS] arrays on the host; None from a dense model) and `forwards`, the micro-batch
    forwards each rank ran in the interval; None when there is no mixture of experts."""
    seen = [s for s in per_rank if s is not None]
    if not seen:
        return None
    # float64, as the model sums them: slot counts stay whole numbers however long the interval.
    ranks = np.stack([np.asarray(s, dtype=np.float64) for s in seen])
    total = ranks.sum(0)
    experts = total.shape[1] - EXTRA_STATS
    # The ranks that ran each layer: all of them, or under a pipeline those of the stage
    # that holds it (the others' rows are zeros: models/llama.py).
    held = np.maximum((ranks[:, :, experts + STAT_TOKENS] > 0).sum(0), 1)
    # Each forward adds its micro-batch's terms: the mean per forward is what the objective
    # added, comparable across micro-batch sizes and world sizes.
    per_forward = (lambda x, n: x / (forwards * n)) if forwards else (lambda x, n: None)
    short = lambda x: None if x is None else float(f"{x:.6g}")  # noqa: E731
    layers = []
    for row, n in zip(total.tolist(), held.tolist()):
        load = [round(x) for x in row[:experts]]
        mean = sum(load) / experts
        layers.append(
            {
                "load": load,
                "imbalance": round(max(load) / mean, 4) if mean > 0 else None,
                "aux": short(per_forward(row[experts + STAT_AUX], n)),
                "balance": short(per_forward(row[experts + STAT_BALANCE], n)),
                "z": short(per_forward(row[experts + STAT_Z], n)),
                "dropped": round(row[experts + STAT_DROPPED]),
            }
        )
    aux = (
        short(sum(per_forward(a, n) for a, n in zip(total[:, experts + STAT_AUX].tolist(), held.tolist()))) if forwards else None
    )
    return {"tokens": round(float(total[0, experts + STAT_TOKENS])), "aux": aux, "layers": layers}
