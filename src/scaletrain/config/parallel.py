"""The parallel layout: dp_replicate x dp_shard x tp x pp x cp = world size, validated once.

Everything that means "data-parallel rank or size" (the loader, the global batch, the loss
mean, DeepSpeed's train_batch_size, the planner) asks a ParallelDims, never the raw world
size: once tensor or pipeline parallelism splits a model over several ranks, those ranks
share one data-parallel rank. The layout of ranks follows torchtitan's: the mesh is
(pp, dp_replicate, dp_shard, cp, tp), row-major, tp innermost (the fastest links).

Which data-parallel dimension a strategy uses is its row's `dp_axis` (strategies.py): ddp
replicates (dp_replicate = dp), ZeRO partitions over its whole data-parallel group
(dp_shard = dp), fsdp shards within groups of dp / parallel.dp_replicate and replicates
across them (hybrid when dp_replicate > 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scaletrain.errors import UserError
from scaletrain.strategies import TABLE, names_where, said

if TYPE_CHECKING:  # torch is imported on first use: planning needs no process group
    import torch
    from torch.distributed.device_mesh import DeviceMesh

# Mesh dimensions, outermost first.
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# What dp_shard is made of under expert parallelism (ParallelDims.ep).
EXPERT_DIMS = ("dp_shard_mod_ep", "ep")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # Expert parallel: not a dimension of its own but a split of dp_shard into
    # (dp_shard / ep, ep), ep innermost (neighbouring ranks, the fastest links): the experts
    # are split over ep, their weights sharded over dp_shard / ep (engines/expert_parallel.py).
    # Under context parallel ep takes the cp ranks in (as torchtitan's layout does): ep =
    # (ep / cp of dp_shard) x cp, so the experts see every token of the sequences they serve
    # and their weights are sharded over the dp_shard / (ep / cp) ranks that hold the same.
    ep: int = 1
    _mesh: Any = field(default=None, repr=False, compare=False)
    _dp_shard: Any = field(default=None, repr=False, compare=False)  # under ep: dp_shard flattened; under cp: dp_shard x cp
    _ep: Any = field(default=None, repr=False, compare=False)  # under ep with cp: (dp_shard_in_ep, cp) flattened

    def __post_init__(self) -> None:
        for name in (*DIMS, "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.dp_shard % self.ep_in_shard or (self.ep > 1 and self.cp > 1 and self.ep % self.cp):
            raise ValueError(f"ep={self.ep} must be a multiple of cp={self.cp} dividing dp_shard x cp={self.dp_shard * self.cp}")

    @property
    def ep_in_shard(self) -> int:
        """How many of the ep ranks are dp_shard ranks: ep, or ep / cp under context parallel."""
        return self.ep // self.cp if self.ep > 1 and self.cp > 1 else self.ep

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (each sees micro_batch samples per micro-batch)."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along every dimension."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the world of {self.world_size}")
        out = {}
        for name in reversed(DIMS):  # tp varies fastest
            size = getattr(self, name)
            rank, out[name] = divmod(rank, size)
        return out

    def dp_rank(self, rank: int) -> int:
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIMS} | {"dp_size": self.dp_size} | ({"ep": self.ep} if self.ep > 1 else {})

    def mesh(self, device_type: str) -> DeviceMesh:
        """The device mesh with every dimension larger than 1 (and dp_shard, which FSDP
        always shards over), named as in DIMS; built once, on first use (a collective)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            names = [n for n in DIMS if getattr(self, n) > 1 or n == "dp_shard"]
            sizes = {n: getattr(self, n) for n in names}
            shard: tuple[str, ...] = ("dp_shard",)
            if self.ep > 1:  # dp_shard as (dp_shard_mod_ep, ep), flattened back under its own name
                # Under cp the ep ranks within dp_shard are only ep / cp: the cp ranks beside
                # them complete the group, (dp_shard_in_ep, cp) flattened as "ep" below.
                shard = EXPERT_DIMS if self.cp == 1 else (EXPERT_DIMS[0], "dp_shard_in_ep")
                at = names.index("dp_shard")
                names[at : at + 1] = shard
                sizes |= {shard[0]: self.dp_shard // self.ep_in_shard, shard[1]: self.ep_in_shard}
            self._mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=tuple(names))
            if self.ep > 1:
                # Kept here: torch deprecates slicing a flattened dimension from the root mesh.
                self._dp_shard = self._mesh[shard]._flatten("dp_shard")
                self._ep = self._mesh[shard[1], "cp"]._flatten(EXPERT_DIMS[1]) if self.cp > 1 else self._mesh[EXPERT_DIMS[1]]
            if self.cp > 1:
                # FSDP shards over the cp ranks too (as torchtitan does): its gradient
                # reduction then averages over dp x cp, each cp rank's loss a mean of its chunks.
                self._dp_shard = self._mesh[(*shard, "cp")]._flatten("dp_shard_cp")
            if len(names) > 1:
                # A reduction over every dimension (the gradient norm of 2-D parameters) is
                # then one all-reduce on the flattened group, not one per dimension in turn.
                self._mesh._flatten()
        return self._mesh

    def expert_meshes(self, device: torch.device) -> tuple[DeviceMesh, DeviceMesh]:
        """Under expert parallelism: (what FSDP2 shards the expert weights over, replicating
        them over dp_replicate under hybrid sharding; the ep group)."""
        mesh = self.mesh(device.type)
        return (mesh["dp_replicate", EXPERT_DIMS[0]] if self.dp_replicate > 1 else mesh[EXPERT_DIMS[0]]), self._ep

    def cp_group(self, device: torch.device) -> Any:
        """The process group of this rank's cp ranks (parallel.cp > 1)."""
        return self.mesh(device.type)["cp"].get_group()

    def fsdp_mesh(self, device: torch.device) -> DeviceMesh:
        """What FSDP2 shards over: dp_shard, or (dp_replicate, dp_shard) for hybrid sharding;
        (dp_shard x cp) flattened under context parallel."""
        mesh = self.mesh(device.type)
        if self.ep > 1 and self.dp_replicate > 1:  # hybrid: replicated over dp_replicate, sharded over the flattened dp_shard
            return mesh["dp_replicate", "dp_shard"]
        if self.ep > 1 or self.cp > 1:  # config/schema.py refuses cp with hybrid sharding
            return self._dp_shard
        return mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else mesh["dp_shard"]


def parallel_dims(
    strategy: str, world_size: int, dp_replicate: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1
) -> ParallelDims:
    """The layout for `strategy` on `world_size` ranks, or a one-line UserError naming the
    closest valid layout."""
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise UserError(
            f"parallel.tp={tp} x parallel.pp={pp}{f' x cp={cp}' if cp > 1 else ''} = {model_parallel} does not divide "
            f"the world size {world_size}; closest valid layout: {_closest_model_parallel(world_size, tp, pp, cp)}"
        )
    dp = world_size // model_parallel
    # auto is laid out as a hybrid-capable sharded strategy: the data-parallel size, all the
    # planner needs before it chooses, is the same for every strategy.
    row = TABLE.get(strategy)
    if dp_replicate > 1 and row is not None and not row.hybrid:
        raise UserError(
            f"parallel.dp_replicate={dp_replicate} (hybrid sharding) needs parallel.strategy="
            f"{said(names_where(lambda s: s.hybrid))}, not {strategy}; closest valid layout: parallel.dp_replicate=1"
        )
    if dp % dp_replicate:
        divisors = _divisors(dp)
        closest = min(divisors, key=lambda d: (abs(d - dp_replicate), d))
        raise UserError(
            f"parallel.dp_replicate={dp_replicate} must divide the data-parallel size {dp} (world size {world_size}"
            + (f" / tp {tp} / pp {pp}" if model_parallel > 1 else "")
            + f"); accepted: {', '.join(map(str, divisors))} (closest valid layout: parallel.dp_replicate={closest})"
        )
    if row is not None and row.dp_axis == "replicate":
        return ParallelDims(dp_replicate=dp, dp_shard=1, tp=tp, pp=pp, cp=cp)
    shard = dp // dp_replicate
    if cp > 1 and ep > 1 and (ep % cp or shard % (ep // cp)):
        # The ep group takes the cp ranks in (ParallelDims.ep): cp times a divisor of dp_shard.
        raise UserError(
            f"parallel.ep={ep} with parallel.cp={cp} must be cp times a divisor of the data-parallel shard size {shard} "
            f"(the ep group holds whole cp groups, whose ranks route the parts of the same sequences); accepted: "
            f"{', '.join(str(cp * d) for d in _divisors(shard))}"
        )
    if cp == 1 and shard % ep:
        raise UserError(
            f"parallel.ep={ep} must divide the data-parallel shard size {shard} (world size {world_size}"
            + (f" / tp {tp} / pp {pp}" if model_parallel > 1 else "")
            + (f" / dp_replicate {dp_replicate}" if dp_replicate > 1 else "")
            + f"); accepted: {', '.join(map(str, _divisors(shard)))}"
        )
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=shard, tp=tp, pp=pp, cp=cp, ep=ep)


def dims_for(parallel: Any, world_size: int) -> ParallelDims:
    """The layout a ParallelConfig asks for on `world_size` ranks (see parallel_dims)."""
    return parallel_dims(
        parallel.strategy, world_size, parallel.dp_replicate, parallel.tp, parallel.pp, cp=parallel.cp, ep=parallel.ep
    )


def describe(engine: str, world_size: int, parallel: dict[str, int] | None) -> str:
    """ "fsdp at world 4 (tp 2)": an engine and its layout, for messages."""
    split = [f"{n} {parallel[n]}" for n in ("tp", "pp", "cp", "ep") if parallel and parallel.get(n, 1) > 1]
    return f"{engine} at world {world_size}" + (f" ({', '.join(split)})" if split else "")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _closest_model_parallel(world_size: int, tp: int, pp: int, cp: int) -> str:
    """The nearest (tp, pp) whose product with cp divides the world: tp moved first."""
    options = [(t, p) for t in _divisors(world_size) for p in _divisors(world_size) if world_size % (t * p * cp) == 0]
    if not options:  # cp itself does not divide the world
        return "parallel.tp=1 x parallel.pp=1 without context parallelism"
    t, p = min(options, key=lambda o: (abs(o[0] - tp) + abs(o[1] - pp), o[1] != pp, -o[0]))
    return f"parallel.tp={t} x parallel.pp={p}"
