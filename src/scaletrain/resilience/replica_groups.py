"""Replica groups (fault_tolerance.groups > 1): training that outlives a failed group.

The job is N replica groups, each a torchrun job of today's layout (ddp, or fsdp with tp)
over its own ranks. Across groups, torchft (PyPI `torchft`) does the rest: a lighthouse
forms a quorum of the live groups before each step; between backward and the optimizer
step the gradients are averaged over the groups in that quorum (rank r of each group with
rank r of the others, which hold the same shards), and the step is applied only if every
group in it says the reduction went through (`should_commit`). A group that fails is left
out of the next quorum and restarted by its own torchrun agent; the others keep their
processes and go on. The restarted group joins a quorum behind the others, and torchft's
transport sends it a live peer's state (rank r's parameters, optimizer state, loss scale
and the trainer's step and data position) before its first step back, so from then on it
computes exactly what its peers compute.

What a step without some group is: its gradient is the mean over the groups present
(torchft's all-reduce divides by the participants), and the samples the missing group
would have read in that step are skipped, not read again (every group reads its own share
of each step's global batch by step position, as one data-parallel job of N x K ranks
would). A step that a group's failure interrupted (the all-reduce errored) is not
applied anywhere and runs again on the next batch.

Checkpoints: group 0 writes them into run.dir; the other groups write none (their state
is group 0's) and keep their metrics in run.dir/replica_groups/group<g>/.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from scaletrain.config import Config
from scaletrain.config.parallel import ParallelDims
from scaletrain.errors import UserError
from scaletrain.launch.distributed import World
from scaletrain.launch.env import GROUP_ENV, LIGHTHOUSE_ENV, START_ENV  # set by `launch --ft-groups`
from scaletrain.launch.groups import require_torchft

START_TIMEOUT_S = 300.0


def group_index(cfg: Config) -> int:
    """This process's replica group (0 without fault tolerance)."""
    groups = cfg.fault_tolerance.groups
    if groups == 1:
        return 0
    value = os.environ.get(GROUP_ENV, "")
    if not value.isdigit() or int(value) >= groups:
        raise UserError(
            f"fault_tolerance.groups={groups} needs {GROUP_ENV}=0..{groups - 1} in each group's environment (got "
            f"{value!r}); accepted: `scaletrain launch --ft-groups {groups}`, which sets it, or the variable set per group"
        )
    return int(value)


def data_ranks(cfg: Config, dims: ParallelDims, rank: int) -> tuple[int, int]:
    """(data-parallel rank, size) over every group: group g's ranks read the shares of the
    step's global batch that ranks g x K .. g x K + K-1 of one job of N x K ranks would."""
    g = group_index(cfg)
    return g * dims.dp_size + dims.dp_rank(rank), cfg.fault_tolerance.groups * dims.dp_size


def group_dir(cfg: Config, root: Path) -> Path:
    """Where a group keeps its metrics and run files: run.dir for group 0."""
    g = group_index(cfg)
    return root if g == 0 else root / "replica_groups" / f"group{g}"


def writes_checkpoints(cfg: Config) -> bool:
    return group_index(cfg) == 0


class NoGroups:
    """fault_tolerance off: nothing to agree on."""

    across = None  # what the engine's step calls first (ReplicaGroups.reduce): nothing

    def before_step(self) -> None:
        pass

    def mean(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def fields(self) -> dict[str, Any]:
        return {}

    def close(self, step: int, clean: bool) -> None:
        pass


class ReplicaGroups:
    """One group's side of the quorum. `trainer_state(in_step)` / `restore(state)`: the
    loop's step, data position and tokens (with `in_step`, as they will be once the step in
    progress ends), sent to and taken from a peer; `event(row)`: a metrics.jsonl event row;
    `engine()`: the run's engine, held by the run alone (its optimizer and module are taken
    once, for torchft's manager and DiLoCo, and let go in close).

    Every step (fault_tolerance.diloco off): a quorum before it, the gradients averaged in
    it: `across`, which the loop hands the engine's step (engines/base.py). With DiLoCo, torchft's
    `DiLoCo` drives the quorum from the optimizer's step hooks: each group steps alone, and
    every sync_every steps the pseudo-gradient (the weights at the last synchronization
    minus the weights now) is averaged over the live groups and the outer optimizer (SGD
    with Nesterov momentum) steps from the old weights; a rejoining group takes its state
    at that point."""

    def __init__(
        self,
        cfg: Config,
        world: World,
        engine: Callable[[], Any],
        step: int,
        trainer_state: Callable[[bool], dict[str, int]],
        restore: Callable[[dict[str, int]], None],
        event: Callable[[dict[str, Any]], None],
    ):
        _quiet_torchft()  # before torchft's import: its Rust servers read RUST_LOG once
        require_torchft()
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        ft = cfg.fault_tolerance
        self.group, self.groups = group_index(cfg), ft.groups
        self.engine, self.optimizer = engine, engine().optimizer
        self.trainer_state, self.restore, self.event = trainer_state, restore, event
        self.world = world
        timeout = timedelta(seconds=ft.timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if world.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        lighthouse = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise UserError(
                f"fault_tolerance.groups={ft.groups} needs a lighthouse; accepted: fault_tolerance.lighthouse=http://HOST:PORT, "
                f"{LIGHTHOUSE_ENV}, or `scaletrain launch --ft-groups {ft.groups}`, which starts one"
            )
        store = _group_store(world)  # the group's own key-value store: torchft's manager finds its rank 0 there
        self.manager = Manager(
            pg=pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=ft.min_groups,
            # The quorum before each step, not overlapped with its forward: a rejoining group
            # then takes its peer's state before its first step back and joins that step.
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timeout,
            rank=world.rank,
            world_size=world.world_size,
            store_addr=store[0],
            store_port=store[1],
            lighthouse_addr=lighthouse,
            replica_id=f"group{self.group}",
            # Every group builds the same weights from train.seed; a group behind the others
            # (restarted, or started fresh beside a resumed group 0) heals from them instead.
            init_sync=False,
        )
        # The manager's step decides who is behind: a resumed run's is its checkpoint's.
        self.manager.load_state_dict({"step": step, "batches_committed": step * ft.groups})
        self._store = store[2]
        self.quorum_id: int | None = None
        self.participants = 0
        self.healed: dict[str, Any] | None = None  # a peer's state taken: applied before the next step
        if world.rank == 0:
            _wait_for_every_group(self.groups)
        self.diloco: Any = None
        if ft.diloco.sync_every:
            from torchft.local_sgd import DiLoCo

            d = ft.diloco
            outer = torch.optim.SGD(_params(self.optimizer), lr=d.outer_lr, momentum=d.outer_momentum, nesterov=True)
            self.diloco = DiLoCo(self.manager, [engine().module], self.optimizer, outer, sync_every=d.sync_every)
            self.diloco.__enter__()  # its hooks on the engine's optimizer
        # Every step without DiLoCo: the gradients averaged over the live groups in the engine's step.
        self.across: Callable[[], bool] | None = self.reduce if self.diloco is None else None

    def before_step(self) -> None:
        """The quorum for the next step (DiLoCo: its synchronizations hold their own); what
        a peer's state brought is applied here, before the step."""
        waited = 0.0
        if self.diloco is None:
            t0 = time.perf_counter()
            self.manager.start_quorum()
            waited = time.perf_counter() - t0
        if self.healed is not None:
            self.restore(self.healed.pop("trainer"))
        self.participants = self.manager.num_participants()
        step = self.trainer_state(False)["step"]
        if _QUORUMS.latest != self.quorum_id:  # a group left or (re)joined
            self.quorum_id = _QUORUMS.latest
            row = {"quorum_id": self.quorum_id, "groups": self.participants, "waited_s": round(waited, 3), "pid": os.getpid()}
            self.event({"event": "quorum", "step": step, "group": self.group} | row)
        if self.healed is not None:
            self.event({"event": "rejoin", "step": step, "group": self.group, "waited_s": round(waited, 3)} | self.healed)
            self.healed = None

    def mean(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's loss averaged over the live groups (what one job of all of them
        reports); under DiLoCo each group's own (the groups hold different weights)."""
        if self.diloco is not None:
            return loss
        loss = loss.detach().clone()
        self.manager.allreduce(loss).wait()
        return loss

    def reduce(self) -> bool:
        """Between backward and the optimizer step: the gradients averaged over the live
        groups; True when every group of the quorum may apply the step."""
        works = [self.manager.allreduce(_local(p.grad)) for p in _params(self.optimizer) if p.grad is not None]
        for work in works:
            work.wait()
        return self.manager.should_commit()

    def fields(self) -> dict[str, Any]:
        return {"groups": self.participants} if self.participants else {}  # DiLoCo: none before its first sync

    def close(self, step: int, clean: bool) -> None:
        """Collective at a clean end: each rank's weights bit for bit (equal in every group of
        the last quorum, rank by rank); then the manager's servers stop."""
        if clean:
            mine = bitwise_digest(self.optimizer)
            hashes = [mine] * self.world.world_size
            if self.world.distributed:
                torch.distributed.all_gather_object(hashes, mine)
            self.event({"event": "replica_group", "step": step, "group": self.group, "weights_sha256": hashes})
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        # The optimizer must not outlive the process group, whatever still holds this object (a
        # traceback's Run); the engine itself is the run's alone (the trainer's _release).
        self.optimizer = self.diloco = self.across = None

    # torchft's transport: what a peer sends (`_state`) and a rejoining group takes (`_load`).
    def _state(self) -> dict[str, Any]:
        params = _params(self.optimizer)
        return {
            "params": [_local(p).detach() for p in params],
            "optim": [{k: _local(v) for k, v in self.optimizer.state[p].items()} for p in params],
            "extra": self.engine().extra_state(),
            # DiLoCo sends from its hook inside the optimizer step: the state after that step.
            "trainer": self.trainer_state(self.diloco is not None),
        }

    def _load(self, state: dict[str, Any]) -> None:
        _ensure_optimizer_state(self.optimizer)
        params = _params(self.optimizer)
        received = 0
        with torch.no_grad():
            for p, value, saved in zip(params, state["params"], state["optim"], strict=True):
                _local(p).copy_(value)
                received += value.numel() * value.element_size()
                for key, v in saved.items():
                    mine = self.optimizer.state[p][key]
                    _local(mine).copy_(v)
                    received += v.numel() * v.element_size()
        self.engine().load_extra_state(state["extra"])
        self.healed = {"received_bytes": received, "from_step": state["trainer"]["step"], "trainer": state["trainer"]}


def bitwise_digest(optimizer: torch.optim.Optimizer) -> str:
    """sha256 over this rank's parameter bytes (its shards under fsdp)."""
    h = hashlib.sha256()
    for p in _params(optimizer):
        h.update(_local(p).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """A group that has not stepped yet has no optimizer state to copy a peer's into: one
    step at learning rate 0 on zero gradients makes it, in the engine's own layout (DTensor
    shards under fsdp), and changes no weight (AdamW's decay is lr x weight_decay = 0)."""
    params = _params(optimizer)
    if all(optimizer.state.get(p) for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


def _group_store(world: World) -> tuple[str, int, Any]:
    """(host, port, keep-alive) of the store torchft's manager meets its group's rank 0 at:
    torchrun's (MASTER_ADDR:MASTER_PORT, served by the group's process group) when the group
    has several ranks, else one of its own on loopback."""
    if world.distributed:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
    from torch.distributed import TCPStore

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    return "localhost", store.port, store


def _wait_for_every_group(groups: int) -> None:
    """The launcher's start barrier (START_ENV): each group's rank 0 checks in once, and the
    first quorum waits until all have, so no group trains its first steps alone. A group
    restarted later passes at once (the count is already complete)."""
    where = os.environ.get(START_ENV)
    if not where:
        return
    from torch.distributed import TCPStore

    host, port = where.rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=START_TIMEOUT_S))
    store.add("started", 1)
    deadline = time.monotonic() + START_TIMEOUT_S
    while store.add("started", 0) < groups:
        if time.monotonic() > deadline:
            raise UserError(f"not every replica group started within {START_TIMEOUT_S:g} s; the others' output says why")
        time.sleep(0.05)


class _QuorumIds(logging.Handler):
    """torchft's manager logs each new quorum's id on its `torchft_quorums` logger (its hook
    for telemetry): the newest one seen."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.latest: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.latest = getattr(record, "quorum_id", self.latest)


_QUORUMS = _QuorumIds()


def _quiet_torchft() -> None:
    """torchft logs every quorum and commit at INFO (Python and its Rust servers): the
    loop's own events say what changed; the quorums' ids are kept (_QUORUMS)."""
    os.environ.setdefault("RUST_LOG", "warn")
    # torchft's transport reads a peer's tensors from a read-only buffer; they are copied at once.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    for name in ("torchft", "torchft_commits", "torchft_errors"):  # its warnings too: "no NCCL flight recorder" on CPU
        logging.getLogger(name).setLevel(logging.ERROR)
    quorums = logging.getLogger("torchft_quorums")
    quorums.setLevel(logging.INFO)
    quorums.propagate = False
    if _QUORUMS not in quorums.handlers:
        quorums.addHandler(_QUORUMS)
