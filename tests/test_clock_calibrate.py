"""`scaletrain plan --calibrate`'s microbenchmarks (planning/clock/calibrate.py): how a GPU's
sweep times a matmul, and its collectives over a node's devices (run here between gloo processes)."""

from __future__ import annotations

import pytest

from scaletrain.planning.clock.calibrate import device_collectives


@pytest.mark.unit
def test_a_long_matmul_is_timed_as_it_comes_and_a_short_one_in_bursts():
    import time

    from scaletrain.planning.clock.calibrate import BURST_SECONDS, gemm_seconds

    calls = []

    def long() -> None:  # longer than a burst: its own
        calls.append(1)
        time.sleep(BURST_SECONDS * 1.5)

    assert gemm_seconds(long, lambda: None) >= BURST_SECONDS * 1.5
    assert len(calls) == 4  # a warm-up and the 3 timed, not timed again in a burst of one
    calls.clear()
    assert gemm_seconds(lambda: calls.append(1), lambda: None) < BURST_SECONDS
    assert len(calls) == 4 + 6 * 20  # then 20 a burst (the most), a warm-up burst and 5 timed


@pytest.mark.dist
def test_a_nodes_collectives_are_swept_by_size_in_processes_of_their_own():
    # The GPU path (one process per device, back to back between syncs) over 2 gloo processes:
    # NCCL's reduce-scatter left out (gloo has none), the sizes small.
    kinds = ("all_reduce", "all_gather", "all_to_all", "send")
    table = device_collectives(2, "gloo", [1 << 12, 1 << 16, 1 << 20], kinds)
    assert set(table) == set(kinds)
    for kind, entry in table.items():
        assert entry["ranks"] == 2 and [r[0] for r in entry["rows"]] == [4096.0, 65536.0, 1048576.0], kind
        times = [r[1] for r in entry["rows"]]
        assert all(t > 0 for t in times) and times == sorted(times), kind  # monotone: a larger buffer never faster
