"""Replica agreement: ranks that hold the same weights by construction (data-parallel
replicas of ddp, zero1, zero2; under tensor parallel, the ranks of one tp group for the
parameters they replicate) are checked every `guards.weight_hash_every` steps.

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
from torch.distributed.tensor import DTensor

from scaletrain.config.parallel import ParallelDims
from scaletrain.launch.distributed import World, side_group
from scaletrain.strategies import strategy


def digest(params: Iterable[torch.Tensor]) -> str:
    sums = [torch.stack([p.detach().sum(dtype=torch.float64), p.detach().double().square().sum()]) for p in params]
    if not sums:
        return ""
    return hashlib.sha256(torch.stack(sums).cpu().numpy().tobytes()).hexdigest()[:16]


def same_on_tp(p: torch.Tensor) -> bool:
    """Whether every rank of a tensor-parallel group holds this parameter's local tensor
    identically: not split over the tp dimension (the norms; with FSDP, per dp shard)."""
    if not isinstance(p, DTensor):
        return True
    names = p.device_mesh.mesh_dim_names or ()
    return "tp" not in names or p.placements[names.index("tp")].is_replicate()


def peer_groups(dims: ParallelDims) -> list[list[int]]:
    """Ranks that must hold identical copies: those that differ only along tp (ranks of
    different pipeline stages hold different parameters)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for rank in range(dims.world_size):
        groups.setdefault((dims.coordinates(rank)["pp"], dims.dp_rank(rank)), []).append(rank)
    return list(groups.values())


class ReplicaCheck:
    """Strategies whose replicas hold whole weights (ddp, zero1, zero2): every rank's
    weights. With tensor parallel: the parameters each tp group replicates (the norms),
    compared within each group. Sharded parameters (fsdp, zero3) differ by design."""

    def __init__(self, world: World, engine_name: str, every: int, hosts: list[str], dims: ParallelDims):
        self.world = world
        self.hosts = hosts
        self.tp = dims.tp > 1
        if self.tp:
            self.groups = peer_groups(dims)
        else:
            self.groups = [list(range(world.world_size))] if strategy(engine_name).whole_replicas else []
        self.every = every if (world.distributed and any(len(g) > 1 for g in self.groups)) else 0
        # The main thread's CPU-side collectives, as the metrics gather.
        self._group = side_group("telemetry") if self.every else None
        self.first_seen = 0  # the first step at which they disagreed (0: never)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def check(self, step: int, params: Iterable[torch.Tensor]) -> dict[str, Any] | None:
        """Collective on due steps: None when every replica agrees, else the event row."""
        if self.tp:
            params = [p.to_local() if isinstance(p, DTensor) else p for p in params if same_on_tp(p)]
        mine = digest(params)
        digests: list[str] = [mine] * self.world.world_size
        dist.all_gather_object(digests, mine, group=self._group)
        split: list[list[int]] = []
        odd: list[int] = []
        for peers in self.groups:
            by_digest: dict[str, list[int]] = {}
            for rank in peers:
                by_digest.setdefault(digests[rank], []).append(rank)
            if len(by_digest) > 1:
                # The largest group is taken as the healthy majority; the others are named.
                ordered = sorted(by_digest.values(), key=len, reverse=True)
                split += ordered
                odd += [r for g in ordered[1:] for r in g]
        if not odd:
            return None
        self.first_seen = self.first_seen or step
        return {
            "step": step,
            "event": "replicas_disagree",
            "what": "tensor-parallel replicated weights" if self.tp else "weights",
            "ranks": odd,
            "hosts": [self.hosts[r] for r in odd],
            "groups": split,
        }
