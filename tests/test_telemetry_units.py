"""Telemetry and guards, piece by piece, in one process: the phase clock, the interval
figures and straggler rule, the weight digest, the hang verdict from flight records, the
fault parsing. The multi-rank behaviour is in test_telemetry.py."""

from __future__ import annotations

import time

import pytest
import torch

from scaletrain.errors import UserError
from scaletrain.launch.distributed import World
from scaletrain.resilience import faults
from scaletrain.resilience.watchdog import stuck_collectives
from scaletrain.resilience.weights import digest
from scaletrain.telemetry.clock import PhaseClock
from scaletrain.telemetry.device import _known_gpu
from scaletrain.telemetry.metrics import Rates, StepRecorder

pytestmark = pytest.mark.unit

RATES = Rates(
    tokens_per_step=1000,
    samples_per_step=4,
    flops_per_token=6e6,
    peak_flops=1e12,
    devices=2,
    memory_bytes=2e9,
    cost_per_gpu_hour=2.0,
    straggler_threshold=0.2,
)


def test_clock_gives_each_phase_the_time_since_the_previous_mark():
    clock = PhaseClock(torch.device("cpu"))
    for _ in range(2):
        clock.start()
        time.sleep(0.02)
        clock.mark("data")
        clock.mark("forward")
        time.sleep(0.04)
        clock.mark("backward")
    sums = clock.take()
    # Sleeps last at least as long as asked; the upper bound only catches a phase mix-up.
    assert 0.04 <= sums["data"] < 0.07 and 0.08 <= sums["backward"] < 0.12 and sums["forward"] < 0.01
    assert clock.take() == {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}


def test_interval_figures_follow_from_the_wall_time_and_the_rates():
    world = World(0, 1, 0, torch.device("cpu"), None)
    clock = PhaseClock(world.device)
    rec = StepRecorder(world, ["h0"], clock, RATES, gpu_hours=1.0)
    for step in (1, 2):
        rec.record(torch.tensor(2.0 * step), torch.tensor(0.5), step=step, lr=1e-3)
    time.sleep(0.05)
    out = rec.flush()
    assert [r["loss"] for r in out.rows] == [2.0, 4.0] and out.rows[0]["grad_norm"] == 0.5
    (interval,) = out.events
    wall = interval["wall_s"]
    assert wall >= 0.05 and interval["step_s"] == wall / 2
    assert interval["tokens_per_s"] == pytest.approx(2000 / wall) and interval["samples_per_s"] == pytest.approx(8 / wall)
    assert interval["mfu"] == pytest.approx(2000 / wall * 6e6 / (2 * 1e12))
    assert interval["gpu_hours"] == pytest.approx(1.0 + 2 * wall / 3600)
    assert interval["cost"] == pytest.approx(2.0 * interval["gpu_hours"])
    (rank,) = out.ranks
    assert rank["host"] == "h0" and rank["steps"] == 2 and rank["comm_s"] is None and rank["mem_peak_bytes"] > 0


def _rank(rank: int, total: float, comm: float) -> dict:
    return {"rank": rank, "host": f"h{rank}", "sample": {"step": 4, "total_s": total, "comm_s": comm}}


def test_a_straggler_is_judged_on_busy_time_not_on_the_step_everyone_shares():
    rec = StepRecorder(World(0, 1, 0, torch.device("cpu"), None), ["h"], PhaseClock(torch.device("cpu")), RATES)
    # Every rank's step lasts 1 s; rank 2 was busy for 0.9 s of it, the others waited for it.
    ranks = [_rank(0, 1.0, 0.4), _rank(1, 1.0, 0.45), _rank(2, 1.0, 0.1), _rank(3, 1.0, 0.42)]
    (flag,) = rec._stragglers(8, ranks)
    assert (
        flag["rank"] == 2 and flag["host"] == "h2" and flag["excess"] == pytest.approx(0.9 / 0.59 - 1)
    )  # busy 0.6, 0.55, 0.9, 0.58: median 0.59
    assert rec._stragglers(8, [_rank(r, 1.0, 0.4) for r in range(3)]) == []
    assert rec._stragglers(8, [*ranks[:3], {**ranks[3], "sample": None}]) == []  # not sampled: not judged


def test_the_weight_digest_sees_one_weight_move_and_nothing_else():
    params = [torch.randn(64, 32), torch.randn(32)]
    same = digest([p.clone() for p in params])
    assert digest(params) == same
    params[0][3, 7] += 1e-3
    assert digest(params) != same


def _summary(step: int, entries: list[tuple[int, str, bool]], idle: float = 10.0) -> dict:
    return {
        "step": step,
        "idle_s": idle,
        "collectives": [{"seq": s, "name": n, "process_group": "['0', 'default_pg']", "retired": r} for s, n, r in entries],
    }


def test_the_hang_verdict_names_the_rank_that_never_entered_the_collective():
    summaries = {
        0: _summary(5, [(41, "gloo:all_reduce", True), (42, "gloo:all_reduce", False)]),
        1: _summary(5, [(41, "gloo:all_reduce", True)], idle=12.0),
        2: _summary(5, [(41, "gloo:all_reduce", True), (42, "gloo:all_reduce", False)]),
    }
    verdict = stuck_collectives(summaries)
    assert verdict["stuck_ranks"] == [1]
    assert verdict["collective"] == {
        "seq": 42,
        "name": "gloo:all_reduce",
        "process_group": "['0', 'default_pg']",
        "waiting_ranks": [0, 2],
        "missing_ranks": [1],
    }
    # A rank whose watchdog could not report (wedged holding the GIL, or dead) is named too.
    assert stuck_collectives({**summaries, 1: None})["stuck_ranks"] == [1]


def test_slowdown_faults_parse_per_rank_and_reject_garbage(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(faults.SLOW_ENV, "compute:0.25@1,comm:0.1,compute:1@0")
    assert faults.slowdown("compute") == 0.25 and faults.slowdown("comm") == 0.1
    monkeypatch.setenv(faults.SLOW_ENV, "disk:1")
    with pytest.raises(UserError, match="KIND:SECONDS"):
        faults.slowdown("compute")


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("Tesla T4", None),
    ],
)
def test_gpu_names_map_to_the_peak_table(name, key):
    assert _known_gpu(name) == key
