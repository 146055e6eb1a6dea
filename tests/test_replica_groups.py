"""Replica groups (fault_tolerance, scaletrain/replica_groups.py): N torchrun groups under
one torchft lighthouse train as one data-parallel job of all their ranks, and a group that
dies rejoins from a live peer while the others keep their processes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from scaletrain.resilience import faults
from scaletrain.telemetry.metrics import read_metrics

from helpers.launch import check, one_line_error, scaletrain, train
from helpers.numerics import assert_same_training
from helpers.runs import base_overrides, eval_overrides, metric_rows

GROUP1 = Path("replica_groups") / "group1"


def ft_launch(groups: int, nproc: int, args: list[str], env: dict[str, str] | None = None, timeout: float = 240) -> Any:
    return scaletrain(["launch", "--ft-groups", str(groups), "--nproc", str(nproc), *args], env=env, timeout=timeout)


def events(run: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run / "metrics.jsonl", events=True) if r.get("event") == kind]


def step_rows(run: Path) -> list[dict[str, Any]]:
    return [r for r in metric_rows(run) if "event" not in r and "loss" in r]


def assert_same_weights_everywhere(run: Path, groups: int = 2) -> None:
    """Each group's closing event: the sha256 of every rank's weight bytes; rank r of every
    group holds the same shard, so the lists are equal when the groups agree bit for bit."""
    ends = [events(run if g == 0 else run / "replica_groups" / f"group{g}", "replica_group") for g in range(groups)]
    assert all(len(e) == 1 for e in ends), ends
    hashes = [e[0]["weights_sha256"] for e in ends]
    assert all(h == hashes[0] for h in hashes), hashes


@pytest.mark.unit
@pytest.mark.parametrize(
    "words, fragments",
    [
        (["parallel.strategy=zero2"], ("needs parallel.strategy=ddp or fsdp", "DeepSpeed's engine")),
        (["parallel.strategy=fsdp", "parallel.pp=2"], ("parallel.pp=2", "not checked yet")),
        (["train.nonfinite=rollback"], ("rollback", "only group 0 holds checkpoints")),
        (["fault_tolerance.min_groups=3"], ("min_groups=3 exceeds", "accepted: 1..2")),
        (["parallel.strategy=fsdp", "fault_tolerance.diloco.sync_every=4"], ("averages whole weights", "accepted")),
    ],
)
def test_what_replica_groups_do_not_combine_with_is_refused_in_one_line(
    tmp_path: Path, words: list[str], fragments: tuple[str, ...]
) -> None:
    proc = scaletrain(["train", "--print-config", "fault_tolerance.groups=2", *words, f"run.dir={tmp_path}"])
    one_line_error(proc, *fragments)


@pytest.mark.unit
def test_a_group_fault_point_is_parsed_and_bad_ones_refused() -> None:
    assert faults.parse("step:5@group1,down:3@group0,step:2@1") == [("step", 5, "group1"), ("down", 3, "group0"), ("step", 2, 1)]
    with pytest.raises(faults.UserError, match="@groupG"):
        faults.parse("step:5@groupx")


@pytest.mark.e2e
@pytest.mark.parametrize(
    "flags, fragment",
    [(["--ft-groups", "1"], "--ft-groups 1"), (["--ft-groups", "2", "--nnodes", "2"], "with --nnodes")],
)
def test_launch_refuses_what_it_cannot_start(small_dataset: Path, tmp_path: Path, flags: list[str], fragment: str) -> None:
    proc = scaletrain(["launch", "--nproc", "1", *flags, *base_overrides(small_dataset, tmp_path / "run")])
    one_line_error(proc, fragment, "accepted: --ft-groups N >= 2")


@pytest.mark.e2e
def test_a_group_without_its_index_or_lighthouse_stops_in_one_line(small_dataset: Path, tmp_path: Path) -> None:
    args = [*base_overrides(small_dataset, tmp_path / "run", steps=2), "fault_tolerance.groups=2"]
    one_line_error(train(args), "SCALETRAIN_FT_GROUP=0..1", "--ft-groups 2")
    env = {k: v for k, v in os.environ.items() if k != "TORCHFT_LIGHTHOUSE"} | {faults.GROUP_ENV: "1"}
    one_line_error(train(args, env=env), "needs a lighthouse", "fault_tolerance.lighthouse=http://HOST:PORT")


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_two_groups_of_one_equal_one_ddp_job_of_two_and_so_does_one_that_lost_a_group(
    small_dataset: Path, tmp_path: Path
) -> None:
    """The acceptance: `launch --ft-groups 2 --nproc 1` = `launch --nproc 2 ddp`, same global
    batch, 12 steps. torchft averages the two groups' gradients (a sum of two, divided by
    2) as DDP's all-reduce does; the suite's tolerances (helpers/numerics.py) hold, and in practice
    the numbers are bit-equal (a sum of two terms has one order).

    Then SCALETRAIN_KILL_AT=step:5@group1: group 1 dies after step 5, its torchrun agent
    restarts it, and it takes group 0's state at its first quorum back. With the
    lighthouse's heartbeat timeout (60 s) longer than that restart, group 0 waits for it at
    the quorum of step 6 instead of going on alone, so every step still has both groups:
    the same numbers again, the job exits 0, group 0's process is the same throughout (the
    pid of its quorum events) and both groups end on the same weights bit for bit."""
    common = [*base_overrides(small_dataset, tmp_path / "x", steps=12), "train.micro_batch=2", *eval_overrides(small_dataset)]
    ref, run, killed = tmp_path / "ddp2", tmp_path / "groups", tmp_path / "killed"
    check(train([*common, f"run.dir={ref}", "parallel.strategy=ddp"], nproc=2))
    check(ft_launch(2, 1, [*common, f"run.dir={run}", "parallel.strategy=ddp"]))
    assert_same_training(run, ref, steps=12)
    # The other group reports the same global numbers (it writes no checkpoint to compare).
    assert [(r["loss"], r["grad_norm"]) for r in metric_rows(run / GROUP1)] == [
        (r["loss"], r["grad_norm"]) for r in step_rows(run)
    ]
    assert [r["groups"] for r in step_rows(run)] == [2] * 12
    assert_same_weights_everywhere(run)
    assert (run / "checkpoints").is_dir() and not (run / GROUP1 / "checkpoints").exists()  # group 0 writes them

    args = [*common, f"run.dir={killed}", "fault_tolerance.heartbeat_timeout_s=60"]
    check(ft_launch(2, 1, args, env={**os.environ, faults.ENV: "step:5@group1"}))
    quorums = events(killed, "quorum")
    assert len(quorums) == 2 and len({q["pid"] for q in quorums}) == 1, quorums  # group 0 never restarted
    assert len({q["pid"] for q in events(killed / GROUP1, "quorum")}) == 2  # group 1 did, once
    (rejoin,) = events(killed / GROUP1, "rejoin")
    assert rejoin["from_step"] == 5 and rejoin["received_bytes"] > 0
    assert_same_training(killed, ref, steps=12)
    assert [r["groups"] for r in step_rows(killed)] == [2] * 12
    assert_same_weights_everywhere(killed)


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_fsdp_inside_groups_of_two_equals_fsdp_at_world_4(small_dataset: Path, tmp_path: Path) -> None:
    """Two groups of 2 fsdp ranks = fsdp at world 4: rank r of each group holds the same
    shards, and the groups average them (the acceptance's second equivalence)."""
    common = [*base_overrides(small_dataset, tmp_path / "x", steps=12), "train.micro_batch=1", "parallel.strategy=fsdp"]
    ref, run = tmp_path / "fsdp4", tmp_path / "groups"
    check(train([*common, f"run.dir={ref}"], nproc=4))
    check(ft_launch(2, 2, [*common, f"run.dir={run}"]))
    assert_same_training(run, ref, steps=12, evals=False)
    assert_same_weights_everywhere(run)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_the_live_group_goes_on_while_a_dead_one_is_down_then_it_rejoins(small_dataset: Path, tmp_path: Path) -> None:
    """`down:5@group1` on fsdp groups of 2: both ranks of group 1 die after step 5 and come
    back late (faults.DOWN_S plus their restart), longer than the lighthouse's heartbeat
    timeout (1 s here): group 0 trains on alone meanwhile (its steps say groups 1), then
    group 1 rejoins, each rank taking its peer rank's DTensor shards and moments, and ends
    on the same weights rank by rank. Each step is slowed (0.2 s, asleep: little CPU) so
    that group 0 is still training when group 1 is back."""
    run = tmp_path / "down"
    args = [
        *base_overrides(small_dataset, run, steps=80), "train.micro_batch=1", "train.log_every=5",
        "parallel.strategy=fsdp", "fault_tolerance.heartbeat_timeout_s=1",
    ]  # fmt: skip
    env = {**os.environ, faults.ENV: "down:5@group1", faults.SLOW_ENV: "compute:0.2"}
    check(ft_launch(2, 2, args, env=env))
    groups = [r["groups"] for r in step_rows(run)]
    assert groups[:5] == [2] * 5 and 1 in groups[5:] and groups[-1] == 2, groups
    (rejoin,) = events(run / GROUP1, "rejoin")
    alone = [r["step"] for r in step_rows(run) if r["groups"] == 1]
    assert rejoin["from_step"] >= max(alone), (rejoin, alone)
    assert len({q["pid"] for q in events(run, "quorum")}) == 1
    assert_same_weights_everywhere(run)
    assert json.loads((run / "run.json").read_text())["world_size"] == 2


class _Engine:
    """What ReplicaGroups needs of an engine: the module, its optimizer, the extra state."""

    def __init__(self, module: Any, optimizer: Any) -> None:
        self.module, self.optimizer = module, optimizer

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass


@pytest.mark.unit
def test_one_diloco_outer_step_is_nesterov_sgd_on_the_pseudo_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """fault_tolerance.diloco wired as configured: after sync_every=2 inner steps, the
    weights are w0 - outer_lr x (g + momentum x buf) with g = w0 - w_inner the pseudo-gradient
    (averaged over the one live group: itself) and buf = g on the first outer step (torch's
    SGD starts its momentum buffer at the gradient), i.e. w0 - outer_lr x (1 + momentum) x g.
    fp32; the tolerance is a few ulps of the weights (1e-6 relative): the outer step is 3
    roundings of the same numbers the formula rounds in another order."""
    import torch
    from torchft.coordination import LighthouseServer

    from scaletrain.config import load_config
    from scaletrain.launch.distributed import ALONE
    from scaletrain.resilience.replica_groups import ReplicaGroups

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    monkeypatch.setenv(faults.GROUP_ENV, "0")
    cfg = load_config(
        [], ["fault_tolerance.groups=2", f"fault_tolerance.lighthouse={lighthouse.address()}", "fault_tolerance.diloco.sync_every=2",
             "fault_tolerance.diloco.outer_lr=0.7", "fault_tolerance.diloco.outer_momentum=0.9"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    w0 = [p.detach().clone() for p in model.parameters()]
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    shadow = torch.nn.Linear(4, 2)  # the same inner steps without DiLoCo: w_inner
    shadow.load_state_dict(model.state_dict())
    shadow_opt = torch.optim.AdamW(shadow.parameters(), lr=0.05)
    state = {"step": 0, "position": 0, "tokens_seen": 0}
    engine = _Engine(model, inner)
    groups = ReplicaGroups(cfg, ALONE, lambda: engine, 0, lambda in_step: dict(state), state.update, lambda row: None)
    try:
        for step in range(2):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            for m, opt in ((model, inner), (shadow, shadow_opt)):
                groups.before_step() if m is model else None
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    finally:
        groups.close(2, clean=False)
        lighthouse.shutdown()
    for w, start, local in zip(model.parameters(), w0, shadow.parameters()):
        g = start - local.detach()
        assert g.abs().max() > 1e-3  # the inner steps moved it
        want = start - 0.7 * (1 + 0.9) * g
        torch.testing.assert_close(w.detach(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_diloco_run_of_two_groups_trains_and_ends_on_the_same_weights(small_dataset: Path, tmp_path: Path) -> None:
    """Two groups stepping alone, synchronized every 4 steps (DiLoCo): the loss falls, and
    after the last synchronization (step 12) both groups hold the same weights bit for bit."""
    run = tmp_path / "diloco"
    args = [
        *base_overrides(small_dataset, run, steps=12),
        "train.micro_batch=2",
        "train.log_every=4",
        "fault_tolerance.diloco.sync_every=4",
    ]
    check(ft_launch(2, 1, args))
    for where in (run, run / GROUP1):
        rows = metric_rows(where)
        assert len(rows) == 12 and sum(r["loss"] for r in rows[-4:]) < sum(r["loss"] for r in rows[:4])
    assert [r["loss"] for r in metric_rows(run)] != [r["loss"] for r in metric_rows(run / GROUP1)]  # each its own data
    assert_same_weights_everywhere(run)


@pytest.mark.unit
def test_diagnose_names_a_group_that_keeps_failing(tmp_path: Path) -> None:
    """Group 1 came back twice (three process ids in its quorum events): a warning naming it;
    group 2 once: no warning. The facts count the steps run with fewer groups."""
    from scaletrain.diagnose.findings import diagnose_run
    from scaletrain.diagnose.run import load_run

    def write(where: Path, rows: list[dict[str, Any]]) -> None:
        where.mkdir(parents=True, exist_ok=True)
        (where / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    (tmp_path / "run.json").write_text(json.dumps({"engine": "ddp", "world_size": 1}))
    steps = [{"step": s, "loss": 5.0, "groups": 3 if s < 4 else 2} for s in range(1, 9)]
    write(tmp_path, [{"event": "quorum", "step": 0, "quorum_id": q, "groups": 3, "pid": 10} for q in (1, 2, 3)] + steps)
    lives = [{"event": "quorum", "step": s, "quorum_id": s, "groups": 3, "pid": 20 + s} for s in (0, 3, 6)]
    rejoins = [{"event": "rejoin", "step": s, "waited_s": 0.5, "received_bytes": 2**20} for s in (3, 6)]
    write(tmp_path / "replica_groups" / "group1", lives + rejoins)
    write(tmp_path / "replica_groups" / "group2", lives[:2] + rejoins[:1])
    found = {f.code: f for f in diagnose_run(load_run(tmp_path))}
    assert found["replica_group_failing"].title == "replica group 1 restarted 2 times"
    assert "rejoined at step 6" in found["replica_group_failing"].evidence[1]
    facts = found["replica_groups"].evidence
    assert "5 of 8 logged steps ran with fewer groups than 3" in facts and "group 2: 1 rejoins" in facts
