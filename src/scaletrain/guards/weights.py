"""Replica agreement: data-parallel replicas that hold the same weights by construction
(ddp, zero1, zero2) are checked every `guards.weight_hash_every` steps.

A flipped bit, a bad kernel on one GPU or a missed all-reduce makes one replica drift
silently: every rank keeps training, the loss still falls, and the checkpoint (rank 0's)
hides it. Each rank reduces its parameters to a digest on the device (float64 sum and sum
of squares of every tensor: identical inputs through the same kernel give identical bits,
and a change of one weight moves them), copies the few numbers once, and the digests are
gathered on the gloo side group: one small collective per check, none per step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from scaletrain.distributed import World, side_group

REPLICATED = ("ddp", "zero1", "zero2")  # fsdp and zero3 hold different shards by design


def digest(params: Iterable[torch.Tensor]) -> str:
    sums = [torch.stack([p.detach().sum(dtype=torch.float64), p.detach().double().square().sum()]) for p in params]
    if not sums:
        return ""
    return hashlib.sha256(torch.stack(sums).cpu().numpy().tobytes()).hexdigest()[:16]


class ReplicaCheck:
    def __init__(self, world: World, engine_name: str, every: int, hosts: list[str]):
        self.world = world
        self.hosts = hosts
        self.every = every if (world.distributed and engine_name in REPLICATED) else 0
        self._group = side_group(
            "telemetry"
        )  # the main thread's CPU-side collectives, as the metrics gather if self.every else None
        self.first_seen = 0  # the first step at which they disagreed (0: never)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def check(self, step: int, params: Iterable[torch.Tensor]) -> dict[str, Any] | None:
        """Collective on due steps: None when every replica agrees, else the event row."""
        mine = digest(params)
        digests: list[str] = [mine] * self.world.world_size
        dist.all_gather_object(digests, mine, group=self._group)
        if len(set(digests)) == 1:
            return None
        self.first_seen = self.first_seen or step
        groups: dict[str, list[int]] = {}
        for rank, d in enumerate(digests):
            groups.setdefault(d, []).append(rank)
        # The largest group is taken as the healthy majority; the others are named.
        ordered = sorted(groups.values(), key=len, reverse=True)
        odd = [r for g in ordered[1:] for r in g]
        return {
            "step": step,
            "event": "replicas_disagree",
            "what": "weights",
            "ranks": odd,
            "hosts": [self.hosts[r] for r in odd],
            "groups": ordered,
        }
