"""The clock under tensor parallel (planning/clock): DTensor's host cost measured over ranks in
step (calibrate.py host_op_tp_in_step), and the collectives a tp step runs beyond its blocks'."""

from __future__ import annotations

import pytest

from scaletrain.config import load_config
from scaletrain.config.batch import settle
from scaletrain.config.parallel import dims_for
from scaletrain.planning import planning_spec
from scaletrain.planning.clock import rates as rates_module
from scaletrain.planning.clock.rates import rates_for
from scaletrain.planning.clock.step import step_time
from scaletrain.planning.hardware import gpu, this_cpu
from scaletrain.planning.planner import setups_for

pytestmark = pytest.mark.unit

H100 = gpu("h100", None)
SMALL_TP2 = ["model.preset=small", "data.seq_len=256", "train.micro_batch=4", "parallel.strategy=fsdp", "parallel.tp=2"]


def _flat(seconds: float) -> dict:
    """A collective's measured rows taking `seconds` at every size."""
    return {"ranks": 2, "rows": [[1.0, seconds], [1e9, seconds]]}


def test_tensor_parallels_host_cost_in_step_is_the_pass_less_its_operations_and_its_eight_collectives(monkeypatch):
    """host_op_tp_in_step: the tp block's pass on two ranks in step, less its operations as the
    clock prices a two-rank run's and its collectives at the rows just measured (with sequence
    parallel four all-gathers and four reduce-scatters, the latter an all-reduce on gloo), over
    the operations the block dispatches. Each operation priced 10 us here, the collectives 1 ms
    (all-gather) and 2 ms (all-reduce): a pass 40 ms longer than those leaves 40 ms / dispatched."""
    from scaletrain.config import ModelConfig
    from scaletrain.models import LlamaSpec, resolve_shape
    from scaletrain.planning.clock import calibrate
    from scaletrain.planning.clock.compute import tp_rank_model
    from scaletrain.planning.clock.trace import block_work

    monkeypatch.setattr(rates_module, "cpu_in_sequence", lambda threads: 1.0)
    monkeypatch.setattr(rates_module, "cpu_bandwidth", lambda threads: 1e10)
    monkeypatch.setattr(rates_module, "_replayed", lambda op, args, threads: 1e-5)
    batch, tokens = calibrate.TP_BLOCK
    spec = LlamaSpec(resolve_shape(ModelConfig(preset="small"), tokens))
    work = block_work(tp_rank_model(spec, 2), batch, tokens, "fp32")
    calls = sum(c.count for p in (work.forward, work.backward) for c in p.calls)
    dispatched = work.forward.dispatched + work.backward.dispatched
    links = {"all_gather": _flat(1e-3), "all_reduce": _flat(2e-3)}
    for side in (1.0, 1.25):  # a two-rank run's operations are priced x side: so are those taken out
        parts = calls * 1e-5 * side + 4 * (1e-3 + 2e-3)
        assert calibrate.host_op_tp_in_step(parts + 0.040, links, side, 2) == pytest.approx(0.040 / dispatched)
    # A pass faster than its parts (the machine sped up between the measurements): none left, not less.
    assert calibrate.host_op_tp_in_step(0.001, links, 1.0, 2) == 0.0


def test_a_two_rank_run_takes_tensor_parallels_host_cost_as_measured_in_step(monkeypatch):
    """Measured over ranks in step, the host's cost per operation under tensor parallel is the
    several-rank runs' as it is (it was measured beside the other rank: not x side again); a
    calibration without it keeps the mesh of one's x side and says so; one process is unchanged."""
    monkeypatch.setattr(rates_module, "_CALIBRATED", {})
    monkeypatch.setattr(rates_module, "calibration", lambda: dict(rates_module._CALIBRATED))
    rates_module._cpu_rates.cache_clear()
    links = {kind: _flat(1e-3) for kind in ("all_reduce", "all_gather")}
    older = {"collectives": links, "side_by_side": 1.5, "host_op_tp_1": 60e-6}
    try:
        rates_module.set_calibration({**older, "host_op_tp_in_step": 200e-6})
        two = rates_for(this_cpu(), 2)
        assert two.host_op_tp == pytest.approx(200e-6)
        assert not any("mesh of one" in n for n in two.notes)
        rates_module.set_calibration(older)
        two = rates_for(this_cpu(), 2)
        assert two.host_op_tp == pytest.approx(90e-6)
        assert any("predates tensor parallel's measurement over ranks in step" in n and "--calibrate" in n for n in two.notes)
    finally:
        rates_module._cpu_rates.cache_clear()


def _comm(*overrides: str) -> dict[str, float]:
    cfg = load_config([], [*SMALL_TP2, *overrides])
    cfg = settle(cfg, dims_for(cfg.parallel, 2).dp_size)
    spec = planning_spec(cfg)
    s = setups_for(cfg, 2, 1, False, spec)[0]
    assert s.tp == 2 and s.dp == 1
    return dict(step_time(spec, s, cfg, H100, 1).largest["comm"])


def test_tensor_parallel_prices_the_embeddings_and_the_heads_collectives_and_the_small_all_reduces():
    """Beyond each block's two reductions each way (doubled by sequence parallel), a profiled tp 2
    run's trace shows the embedding's output reduced and the head's input gathered, forward and
    backward, and small all-reduces: three for loss parallel's cross entropy, one per FSDP unit
    for the sequence-parallel norms' gradients (6 blocks and the root), one for the gradient norm."""
    r = rates_for(H100, 2)
    mib = 4 * 256 * 256 * 4  # micro-batch x tokens x hidden, fp32: each reduction's full buffer
    pair = r.collective("all_gather", mib, 2, 0) + r.collective("reduce_scatter", mib, 2, 0)
    comm = _comm()
    assert comm["tensor parallel's 48 collectives (1.0 MiB each)"] == pytest.approx(24 * pair)
    assert comm["tensor parallel's 4 collectives at the embedding and the head"] == pytest.approx(2 * pair)
    small = 3 * r.collective("all_reduce", 4 * 256 * 4, 2, 0) + 8 * r.collective("all_reduce", 2 * 256 * 4, 2, 0)
    assert comm["tensor parallel's 11 small all-reduces (the loss, the norms' gradients)"] == pytest.approx(small)
    # Without sequence parallel each reduction is one all-reduce, and the norms' gradients are whole on every rank.
    plain = _comm("parallel.sequence_parallel=false")
    assert plain["tensor parallel's 2 collectives at the embedding and the head"] == pytest.approx(
        2 * r.collective("all_reduce", mib, 2, 0)
    )
    assert plain["tensor parallel's 4 small all-reduces (the loss, the norms' gradients)"] == pytest.approx(
        3 * r.collective("all_reduce", 4 * 256 * 4, 2, 0) + r.collective("all_reduce", 2 * 256 * 4, 2, 0)
    )
