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


@pytest.mark.unit
def test_float8_products_are_swept_at_the_calls_the_float8_block_makes_and_priced_from_them():
    """The GPU sweep's float8 rows (clock/float8_rates.py), run here on the CPU (torch 2.13 runs
    torch._scaled_mm there): every product the tiny preset's float8 block makes, forward (e4m3)
    and backward (e5m2 first), timed; a GPU table holding them prices those products from them
    and says nothing of the datasheet, and one without them falls back and says so."""
    from dataclasses import replace

    import torch

    from scaletrain.config import load_config
    from scaletrain.models import model_spec
    from scaletrain.planning.clock.calibrate import gemm_seconds
    from scaletrain.planning.clock.float8_rates import float8_calls, float8_rows
    from scaletrain.planning.clock.rates import rates_for
    from scaletrain.planning.hardware import gpu

    spec = model_spec(load_config([], ["model.preset=tiny"]), 64)
    timed = []

    def timer(call) -> float:
        out = call()
        assert out.dtype == torch.bfloat16  # the product ran, in the traced dtypes and layouts
        timed.append(out.shape)
        return gemm_seconds(call, lambda: None)

    rows = float8_rows([spec], "cpu", timer, tokens=(64,))
    calls = float8_calls([spec], (64,))  # the tiny block's 7 converted Linear layers x 3 products, distinct
    assert set(rows) == {"float8_e4m3fn", "float8_e5m2"} and len(timed) == len(calls) > 0
    assert sorted((d, m, n, k) for d, r in rows.items() for m, n, k, _ in r) == sorted(calls)
    assert all(rate > 0 for r in rows.values() for *_, rate in r)
    h200 = gpu("h200", None)
    base = rates_for(h200)
    with_rows = replace(base, _table={**base._table, "matmul": {**base._table["matmul"], **rows}})
    (key, call) = sorted(calls.items())[0]
    want = next(rate for m, n, k, rate in rows[key[0]] if (m, n, k) == key[1:])
    assert with_rows._matmul_rate(call) == pytest.approx(want)
    assert with_rows.float8_note() is None
    assert base.float8_note() and "no float8 matmul measured for h200" in str(base.float8_note())
    assert base._matmul_rate(call) == pytest.approx(base._matmul_rate(replace(call, dtype="bfloat16")) * 1979 / 989, rel=1e-3)


@pytest.mark.unit
def test_a_pass_and_its_operations_are_timed_in_alternation_so_a_machine_slowing_between_does_not_move_the_ratio(monkeypatch):
    """This machine's speed moves by ~10% within seconds (measure.py ALTERNATIONS): a ratio of
    one measurement of the operations and one of the pass, taken apart, moved with it. Here a
    machine (a clock of its own) that runs at half speed from about halfway through the seven
    alternations: the pass costs 1.2x its operations at either speed (in_sequence), and 2 us
    of host per dispatched operation at full speed (host_op_seconds; 4 at half), and the
    medians say so. Planted: every alternation's operations timed before any pass
    (in_sequence 2.4: operations at full speed, passes at half)."""
    from types import SimpleNamespace

    from scaletrain.planning.clock import measure

    clock = {"t": 0.0, "halfway": 0.0}
    slow = lambda: 2.0 if clock["t"] >= clock["halfway"] else 1.0  # noqa: E731
    calls = [SimpleNamespace(count=c) for c in (1, 2, 3)]  # 6 operations' worth, at 1 ms each
    phase = SimpleNamespace(calls=calls, dispatched=5)
    work = SimpleNamespace(forward=phase, backward=SimpleNamespace(calls=[], dispatched=5))

    def spend(seconds: float) -> None:
        clock["t"] += seconds * slow()

    pass_seconds = {"s": 0.0}
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: clock["t"]))
    monkeypatch.setattr(measure, "block_work", lambda *a, **k: work)
    monkeypatch.setattr(measure, "_plain_block", lambda *a, **k: lambda: spend(pass_seconds["s"]))
    prepare = lambda c: lambda: spend(1e-3)  # noqa: E731
    kept = lambda c: pytest.fail("a call that could be built was priced by its kept time")  # noqa: E731

    # One alternation is 6 calls a call and 6 passes (warm-ups included): halfway through the seven.
    pass_seconds["s"] = 6e-3 * 1.2 + 10 * 2e-6
    clock["t"], clock["halfway"] = 0.0, 3.5 * 6 * (6 * 1e-3 + pass_seconds["s"])
    assert measure.in_sequence(prepare, kept, 2e-6) == pytest.approx(1.2)
    pass_seconds["s"] = 6e-3 + 10 * 2e-6
    clock["t"] = 0.0
    assert measure.host_op_seconds(kept, prepare=prepare) == pytest.approx(2e-6)
    # A call that cannot be built is priced at its kept time, the same in every alternation.
    pass_seconds["s"] = (6e-3 - 1e-3 + 0.5e-3) * 1.2 + 10 * 2e-6
    clock["t"] = 0.0
    built_except_first = lambda c: None if c is calls[0] else prepare(c)  # noqa: E731
    assert measure.in_sequence(built_except_first, lambda c: 0.5e-3, 2e-6) == pytest.approx(1.2)
