"""The planner's clock (planning/clock): the traced operations, the rates they are priced at,
and the step they add up to, phase by phase."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from scaletrain.config import ModelConfig, load_config
from scaletrain.config.batch import settle
from scaletrain.config.parallel import dims_for
from scaletrain.models import LlamaSpec, resolve_shape
from scaletrain.planning import planning_spec
from scaletrain.planning.clock import rates as rates_module
from scaletrain.planning.clock.calibrate import monotone
from scaletrain.planning.clock.compute import micro_batch, tp_rank_model
from scaletrain.planning.clock.rates import _interpolate, load_table, rates_for
from scaletrain.planning.clock.replay import arguments, seconds
from scaletrain.planning.clock.step import step_time
from scaletrain.planning.clock.trace import block_work, embedding_work, head_work, matmul_layout
from scaletrain.planning.hardware import KNOWN_GPUS, gpu, gpu_kind, this_cpu
from scaletrain.planning.planner import setups_for
from scaletrain.planning.setup import Setup

from helpers.launch import scaletrain

pytestmark = pytest.mark.unit

TINY = LlamaSpec(resolve_shape(ModelConfig(preset="tiny"), 512))
H100 = gpu("h100", None)


def _block_params(spec: LlamaSpec) -> int:
    return spec.counts().block


def test_a_blocks_matmuls_are_its_weights_times_the_tokens_forward_and_twice_backward():
    # 2 FLOPs per multiply-add: forward x @ W^T is 2 x weights per token; backward the input's
    # and the weight's gradients, twice that. The norms' gains are not matmul weights.
    work = block_work(TINY, 2, 16, "fp32")
    matmul_weights = _block_params(TINY) - 2 * TINY.shape.dim
    forward = sum(c.flops * c.count for c in work.forward.of("matmul"))
    backward = sum(c.flops * c.count for c in work.backward.of("matmul"))
    assert forward == 2 * matmul_weights * 2 * 16
    assert backward == 2 * forward


def test_causal_attention_counts_the_lower_triangle_and_backward_five_products():
    work = block_work(TINY, 2, 16, "fp32")
    (fwd,) = work.forward.of("attention")
    (bwd,) = work.backward.of("attention")
    heads, d, t = TINY.shape.n_heads, TINY.shape.head_dim, 16
    pairs = t * (t + 1) / 2  # is_causal: the kernel runs the diagonal and below
    assert fwd.shape == (2 * heads, t, t, d, 1)
    assert fwd.flops == 2 * 2.0 * 2 * heads * pairs * d
    assert bwd.flops == pytest.approx(fwd.flops * 5 / 2)


def test_the_head_holds_the_output_projection_and_the_embedding_its_dense_gradient():
    head = head_work(TINY, 2, 16, "fp32")
    vocab, dim, tokens = TINY.vocab_size, TINY.hidden_size, 32
    assert sum(c.flops * c.count for c in head.forward.of("matmul")) == 2 * vocab * dim * tokens
    emb = embedding_work(TINY, 2, 16, "fp32")
    assert not emb.forward.of("matmul")
    # The gradient of the whole table is written (vocab x dim fp32) whatever the tokens.
    assert max(c.nbytes for c in emb.backward.calls) >= vocab * dim * 4


def test_compiled_passes_move_less_than_eager_ones_and_in_fewer_kernels():
    work = block_work(TINY, 4, 64, "pure16")
    for p in (work.forward, work.backward):
        eager = sum(c.nbytes * c.count for c in p.of("memory"))
        assert 0 < p.fused_bytes < eager
        assert 0 < p.fused_kernels < sum(c.count for c in p.of("memory"))


def test_a_replayed_call_is_rebuilt_with_the_traced_shapes_and_timed():
    work = block_work(TINY, 2, 16, "fp32")
    mm = work.forward.of("matmul")[0]
    args, _ = arguments(mm.op, mm.args)
    assert [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)] == [tuple(t["t"][0]) for t in json.loads(mm.args)[0]]
    assert seconds(mm.op, mm.args) > 0


def test_measured_curves_interpolate_and_never_fall_with_size():
    rows = monotone([[1024, 2.0], [4096, 1.0], [16384, 3.0]])  # a jittery small point: the larger one's time bounds it
    assert rows == [[1024, 1.0], [4096, 1.0], [16384, 3.0]]
    assert _interpolate(rows, 512) == 1.0
    assert _interpolate(rows, 10240) == pytest.approx(2.0)
    assert _interpolate(rows, 28672) == pytest.approx(5.0)  # past the end: the last segment's cost per byte


def test_ranks_side_by_side_are_priced_as_slow_as_they_ran_beside_each_other(monkeypatch):
    """A CPU run's ranks share the machine's caches, memory and, on hardware threads, its cores:
    each rank's compute and host cost are priced at the calibration's side-by-side factor
    (calibrate.py _in_step); one process is not."""
    monkeypatch.setattr(rates_module, "_CALIBRATED", {})
    monkeypatch.setattr(rates_module, "calibration", lambda: dict(rates_module._CALIBRATED))
    # This machine's own measurements held fixed: the rule is the factor, not a replay's time. A
    # replay or pass factor timed while the suite's other worker held the CPUs is measured again
    # once the machine is quiet (cpu_measured._QuietCache), so the two pricings below could read
    # two timings of one operation (the full suite here, 2026-12-02: every call 4.6% apart).
    monkeypatch.setattr(rates_module, "_replayed", lambda op, args, threads: 1e-6 * (1 + len(str(args)) % 7))
    monkeypatch.setattr(rates_module, "cpu_host_op", lambda threads: 5e-6)
    monkeypatch.setattr(rates_module, "cpu_in_sequence", lambda threads: 1.1)
    monkeypatch.setattr(rates_module, "cpu_bandwidth", lambda threads: 2e10)
    rates_module._cpu_rates.cache_clear()
    links = {kind: {"ranks": 2, "rows": [[1.0, 0.0], [1e6, 1.0]]} for kind in ("all_reduce", "all_gather")}
    calls = [c for c in block_work(TINY, 2, 16, "fp32").forward.calls]
    try:
        priced = {}
        for side in (1.0, 1.5):
            rates_module.set_calibration({"collectives": links, "side_by_side": side})
            r = rates_for(this_cpu(), 2)
            priced[side] = ([r.call(c) for c in calls], r.host_op, r.source, rates_for(this_cpu(), 1).host_op)
        (alone, host, _, one), (beside, host15, said, one15) = priced[1.0], priced[1.5]
        assert beside == pytest.approx([1.5 * t for t in alone], rel=1e-9) and host15 == pytest.approx(1.5 * host)
        assert "x1.50 beside the other ranks" in said and one15 == one  # one process: as before
        # A calibration from before the factor was measured says so, and prices the ranks as alone.
        rates_module.set_calibration({"collectives": links})
        r = rates_for(this_cpu(), 2)
        assert [r.call(c) for c in calls] == pytest.approx(alone, rel=1e-9)
        assert any("predates the ranks-side-by-side measurement" in n for n in r.notes)
    finally:
        rates_module._cpu_rates.cache_clear()


class _Pair:
    """torch.distributed as one rank of two sees it, the other rank's times made up: its pass
    alone `alone` times this rank's, in step `in_step` times."""

    class ReduceOp:
        SUM, MAX = "sum", "max"

    def __init__(self, alone: float, in_step: float) -> None:
        self.alone, self.in_step = alone, in_step

    def barrier(self) -> None:
        pass

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        t.copy_(torch.maximum(t, t * self.in_step) if op == "max" else t * (1 + self.alone))


def test_ranks_in_step_are_as_slow_as_the_slowest_of_them_each_pass(monkeypatch):
    """calibrate.py _in_step: every pass in step lasts as long as its slowest rank's, against
    the ranks' mean alone. Here a fake clock makes each of this rank's passes 60 ms, alone or in
    step, and the other rank's in step 1.5x that: exactly 1.5. A rank that took its own passes
    only (no MAX over the ranks) would read 1.0, the two ranks' passes summed 2.0."""
    import time as time_module

    from scaletrain.planning.clock import calibrate, measure

    now = [0.0]

    def passing() -> None:
        now[0] += 0.06

    monkeypatch.setattr(calibrate, "_plain_block", lambda *a, **k: passing)
    monkeypatch.setattr(time_module, "perf_counter", lambda: now[0])
    assert measure.time.perf_counter is time_module.perf_counter  # median_seconds reads this clock too
    assert calibrate._in_step(_Pair(1.0, 1.5), 0, 2) == pytest.approx(1.5)
    # In step never faster than alone: where the other rank ran slower alone (the machine drifting
    # between the two), not below 1.
    assert calibrate._in_step(_Pair(1.5, 1.0), 0, 2) == 1.0


def test_a_collective_scales_with_the_bytes_each_rank_moves_and_gloo_reduces_scatters_as_all_reduces():
    table = {
        "collectives": {"intra": {kind: {"ranks": 2, "rows": [[1.0, 0.0], [1e6, 1.0]]} for kind in ("all_reduce", "all_gather")}}
    }
    r = replace(rates_for(this_cpu(), 1), _table=table)
    # At 4 ranks each rank sends 3/4 of an all-gather's buffer, at 2 ranks 1/2: 1.5x the bytes.
    assert r.collective("all_gather", 1e5, 4, False) == pytest.approx(r.collective("all_gather", 1.5e5, 2, False))
    assert r.collective("reduce_scatter", 1e5, 2, False) == r.collective("all_reduce", 1e5, 2, False)
    assert r.collective("all_reduce", 1e5, 1, False) == 0.0


def test_a_ring_across_nodes_uses_a_nic_for_each_of_the_groups_ranks_on_a_node():
    h100 = rates_for(gpu("h100", "80GiB"), 8)  # no measured table: the datasheet's links
    lat = h100.latency(True)
    one, eight = (h100.collective("all_gather", 1e9, 64, k) - lat for k in (1, 8))
    # 1 GB over 64 ranks: 63/64 of it through each rank's 400 Gb/s NIC at 80%, or through 8 side by side.
    assert one == pytest.approx(63 / 64 * 1e9 / (0.8 * 50e9)) and eight == pytest.approx(one / 8)
    # Never faster than NVLink inside the node carries it (450 GB/s here: 9 NICs' worth).
    assert h100.collective("all_gather", 1e9, 64, 16) == pytest.approx(h100.collective("all_gather", 1e9, 64, 9))
    # An all-to-all or a pipeline's send leaves through each rank's own NIC, however many share a node.
    for kind in ("all_to_all", "send"):
        assert h100.collective(kind, 1e9, 64, 8) == h100.collective(kind, 1e9, 64, 1)
    # Inside a node, NVLink.
    assert h100.collective("all_gather", 1e9, 8, 0) - h100.latency() == pytest.approx(7 / 8 * 1e9 / (0.8 * 450e9))


def test_gpu_names_map_to_their_kinds():
    assert gpu_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_kind("NVIDIA H100 PCIe") == "h100-pcie"
    assert gpu_kind("NVIDIA H200") == "h200"
    assert gpu_kind("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert gpu_kind("NVIDIA RTX 6000 Ada Generation") == "nvidia-rtx-6000-ada-generation"
    assert {d.kind for d in KNOWN_GPUS.values()} == set(KNOWN_GPUS)


def test_an_unmeasured_gpu_kind_says_it_was_priced_from_its_datasheet(monkeypatch):
    monkeypatch.setattr(rates_module, "_read_table", lambda kind: {})
    r = rates_for(gpu("l40s", None))
    assert "datasheet" in r.source
    assert any("no measured table for L40S" in n and "--calibrate" in n for n in r.notes)


def test_a_table_of_another_torch_is_used_and_said(monkeypatch):
    monkeypatch.setattr(rates_module, "_read_table", lambda kind: {"torch": "1.0.0", "matmul": {}})
    table, notes = load_table("h100")
    assert table and notes == [f"the h100 table was measured with torch 1.0.0, this is {torch.__version__}: used as it is"]


def _setup(**changes) -> Setup:
    return replace(Setup("fsdp", 1, 4, 64, "fp32"), **changes)


def _time(spec, s: Setup, device=H100, nodes: int = 1, **train):
    cfg = load_config([], [f"train.{k}={v}" for k, v in train.items()])
    return step_time(spec, s, cfg, device, nodes)


def test_phases_add_up_to_the_step_and_activation_checkpointing_repeats_each_blocks_forward():
    plain = _time(TINY, _setup())
    ac = _time(TINY, _setup(activation_checkpointing=True))
    selective = _time(TINY, _setup(activation_checkpointing=True, selective=True))
    assert plain.total == pytest.approx(sum(plain.phases.values()))
    assert ac.phases["forward"] == pytest.approx(plain.phases["forward"]) == selective.phases["forward"]
    # The recompute is every block's forward once more up to the last tensor its backward
    # reads (torch's early stop: not the last product, w2, nor the residual add after it),
    # host included; selective, of that, what models/selective_ac.py does not keep
    # (tests/test_selective_ac.py checks both against what a real backward dispatches).
    block = block_work(TINY, 4, 64, "fp32")
    from scaletrain.planning.clock.compute import price

    r = rates_for(H100)
    assert block.recompute is not None and block.selective is not None
    assert ac.phases["backward"] - plain.phases["backward"] == pytest.approx(
        TINY.n_blocks * price(block.recompute, r, False).seconds
    )
    assert selective.phases["backward"] - plain.phases["backward"] == pytest.approx(
        TINY.n_blocks * price(block.selective, r, False).seconds
    )
    whole = price(block.forward, r, False).seconds
    assert price(block.selective, r, False).seconds < price(block.recompute, r, False).seconds < whole


def test_one_rank_has_no_communication_and_a_pipeline_a_bubble():
    one = _time(TINY, _setup())
    assert one.phases["comm"] == 0 and one.phases["bubble"] == 0
    untied = LlamaSpec(replace(TINY.shape, tie_embeddings=False))
    pp = _time(untied, _setup(pp=2, dp=1, grad_accum=4, reshard_after_forward=False), nodes=1)
    # 1f1b: (pp - 1) / (m + pp - 1) of the step idles: 1/5 of it at 4 micro-batches.
    busy = pp.phases["forward"] + pp.phases["backward"]
    assert pp.phases["bubble"] == pytest.approx(busy * (1 / 5) / (4 / 5))
    assert pp.phases["comm"] > 0


def test_tensor_parallel_prices_a_ranks_split_block_and_dtensors_host():
    split = tp_rank_model(TINY, 2)
    assert split is not None and split.shape.n_heads == TINY.shape.n_heads // 2 and split.shape.head_dim == TINY.shape.head_dim
    flops = lambda spec: sum(c.flops * c.count for c in block_work(spec, 4, 64, "fp32").forward.of("matmul"))  # noqa: E731
    assert flops(split) == pytest.approx(flops(TINY) / 2)
    tp = _time(TINY, _setup(tp=2, dp=1))
    assert tp.phases["comm"] > 0
    assert any("tensor parallel" in label for label, _ in tp.largest["comm"])


def test_more_data_parallel_ranks_add_exposed_communication_on_a_cpu():
    cpu = this_cpu()
    one = _time(TINY, _setup(), device=cpu)
    two = _time(TINY, _setup(dp=2), device=cpu)
    assert one.phases["comm"] == 0 < two.phases["comm"]


def test_float8_pays_where_its_weight_casts_spread_over_enough_tokens():
    # Compiled, the casts fused into their neighbours: each weight's cast per pass costs the
    # same at any micro-batch, the products' saving grows with the tokens. Eager, torchao's
    # casts are separate kernels over every activation (amax, scale, clamp, copy): float8 is
    # slower than bf16 at any size. The float8 block as traced (clock/trace.py), on the
    # datasheet's rates (the H100 has no measured table): the rule, not a table's entries.
    spec = LlamaSpec(resolve_shape(ModelConfig(preset="1b"), None))
    h100 = gpu("h100", None)
    ratio = lambda mb, **train: (
        _time(spec, Setup("fsdp", 1, mb, 2048, "bf16"), h100, **train).total
        / _time(  # noqa: E731
            spec, Setup("fsdp", 1, mb, 2048, "bf16", float8=True), h100, **train
        ).total
    )
    assert ratio(1, compile="true") < 1.1 < ratio(4, compile="true") < ratio(16, compile="true")
    assert ratio(16) < 1


def test_the_plan_uses_the_clock_and_explains_it(tmp_path):
    proc = scaletrain(["plan", "model.preset=tiny", "parallel.strategy=fsdp", "--gpus-per-node", "1", "--explain-time", "--json"])
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    chosen = next(c for c in plan["candidates"] if c["strategy"] == plan["chosen"])
    assert plan["time"]["seconds"] == pytest.approx(chosen["step_time_s"])
    assert set(plan["time"]["phases"]) == {"data", "forward", "backward", "optimizer", "comm", "bubble", "offload", "other"}
    assert plan["time"]["largest"]["forward"]
    text = scaletrain(["plan", "model.preset=tiny", "parallel.strategy=fsdp", "--gpus-per-node", "1", "--explain-time"]).stdout
    assert "predicted step of fsdp" in text and "forward" in text and "datasheet" in text


def test_cpu_plans_price_what_this_machine_runs():
    cfg = load_config([], ["model.preset=tiny", "data.seq_len=64", "train.micro_batch=2", "run.device=cpu"])
    cfg = settle(cfg, dims_for(cfg.parallel, 1).dp_size)
    spec = planning_spec(cfg)
    s = setups_for(cfg, 1, 1, False, spec)[0]
    t = step_time(spec, s, cfg, this_cpu(), 1)
    assert "measured on this CPU" in t.source and t.total > 0


@pytest.mark.unit
def test_a_run_that_only_checks_its_configured_layout_is_planned_without_the_clock(monkeypatch):
    # scaletrain train plans its configured layout for the memory lines it logs; pricing a
    # step would replay its operations on a CPU (seconds for each new shape) for nothing.
    import math

    from scaletrain.planning import planner

    cfg = load_config([], ["model.preset=tiny", "run.device=cpu", "parallel.strategy=ddp"])
    monkeypatch.setattr(planner, "step_time", lambda *a, **k: pytest.fail("the clock ran"))
    plan = planner.make_plan(cfg, planning_spec(cfg), 1, 1, this_cpu(), all_strategies=False, as_configured=True, timed=False)
    assert plan.chosen.time is None and math.isnan(plan.chosen.step_time) and plan.chosen.fits
    assert plan.reasons[0].startswith("ddp as configured: needs ") and "estimated" not in plan.reasons[0]
    # A choice needs the clock, untimed or not: auto plans every layout with it.
    monkeypatch.undo()
    auto = load_config([], ["model.preset=tiny", "run.device=cpu", "parallel.strategy=auto", "data.seq_len=32"])
    chosen = planner.make_plan(auto, planning_spec(auto), 1, 1, this_cpu(), timed=False).chosen
    assert chosen.time is not None and chosen.step_time > 0


def _rates_with(table: dict) -> rates_module.Rates:
    """The H200's prices from `table` alone (not the committed one)."""
    h200 = gpu("h200", None)
    return rates_module.Rates("h200", "test", True, 2e-5, 6e-5, 1e-5, 4e12, [], table, h200)


def test_a_tables_optimizer_and_attention_are_read_as_they_were_measured():
    # AdamW measured at two sizes: its fixed cost and bytes' rate. The first H200 table's single
    # 32M-parameter step scaled up (1.05e12 B/s, its fixed cost scaled with it) is not used: a
    # pass over memory at the table's bandwidth instead (~3.8e12 B/s moved in the profiled 1b step).
    params = 1.2e9
    assert _rates_with({"optimizer_fixed_s": 1e-3, "optimizer_bytes_per_s": 3e12}).optimizer(params, 100) == pytest.approx(
        1e-3 + 40 * params / 3e12
    )
    assert _rates_with({"optimizer_bytes_per_s": 1.05e12}).optimizer(params, 100) == pytest.approx(
        40 * params / 4e12 + 600 * 1e-5
    )
    # Attention at 2048 tokens, head size 64: an old table's rows measured on 2^16 / length heads
    # (a few GFLOPs a call: launch-bound) give way to the datasheet factor; its 16k-and-longer rows
    # serve lengths within 2x; a table measured on enough heads is read at every length.
    call = rates_module.Call("aten._scaled_dot_product_flash_attention_backward.default", "attention", "", 1e12, 0, 1,
                             (512, 2048, 2048, 64, 1))  # fmt: skip
    rows = [[2048, 64, 1.1e14], [16384, 64, 4.0e14], [32768, 64, 4.1e14]]
    datasheet = rates_module.DATASHEET_ATTENTION * gpu("h200", None).peak_flops_16
    old = {"attention": {"forward": rows, "backward": rows}}
    assert _rates_with(old).call(call) == pytest.approx(1e12 / datasheet)
    long_call = replace(call, shape=(8, 18000, 18000, 64, 1))  # nearest measured: 16384
    assert _rates_with(old).call(long_call) == pytest.approx(1e12 / 4.0e14)
    new = {"attention": {"forward": rows, "backward": rows, "heads": "2^31 / length^2, at least 8"}}
    assert _rates_with(new).call(call) == pytest.approx(1e12 / 1.1e14)
    # Past the longest length measured, the longest's rate (a floor: the kernel's rate does not
    # fall with the length), in both formats, not the datasheet factor; a call traced at 16k tokens
    # priced for 193,536 runs at the rate of that length, not of the traced one.
    longer = replace(call, shape=(8, 193536, 193536, 64, 1))
    assert _rates_with(old).call(longer) == pytest.approx(1e12 / 4.1e14)
    assert _rates_with(new).call(longer) == pytest.approx(1e12 / 4.1e14)
    # cuDNN's attention measured beside FlashAttention: priced where train.attention_kernel=auto takes
    # it (forward and backward together at least 5% faster), FlashAttention's elsewhere.
    for cudnn_rate, priced in ((2.2e14, 2.2e14), (1.12e14, 1.1e14)):
        cudnn = [[2048, 64, cudnn_rate], [16384, 64, 4.0e14], [32768, 64, 4.1e14]]
        both = {"attention": {**new["attention"], "cudnn": {"forward": cudnn, "backward": cudnn}}}
        assert _rates_with(both).call(call) == pytest.approx(1e12 / priced)
    traced = replace(call, shape=(8, 16384, 16384, 64, 1))
    assert _rates_with(old).call(traced) == pytest.approx(1e12 / 4.0e14)
    assert _rates_with(old).call(traced, 193536) == pytest.approx(1e12 / 4.1e14)


def test_a_sequence_traced_shorter_is_priced_at_its_own_lengths_attention_rate():
    # The 1b preset at 193,536 tokens is traced at 16,384 and its attention scaled by the square of
    # the length: the kernel runs at the whole length, so the table's rate there (the longest
    # measured: 32k) prices it, not the 16k row's (30% slower in the first H200 table).
    cfg = load_config([], ["model.preset=1b", "data.seq_len=193536", "train.micro_batch=1", "precision=bf16",
                           "parallel.strategy=fsdp", "parallel.activation_checkpointing=true"])  # fmt: skip
    model = planning_spec(cfg)
    s = setups_for(cfg, 1, 1, False, model)[0]
    assert s.strategy == "fsdp" and s.activation_checkpointing and s.seq_len == 193536

    def step(rows: list[list[float]]) -> float:
        table = {"attention": {"forward": rows, "backward": rows, "heads": "2^31 / length^2, at least 8"}}
        mb = micro_batch(model, s, _rates_with(table), False)
        return mb.forward + mb.backward

    both = step([[16384, 64, 2.0e14], [32768, 64, 4.0e14]])
    short = step([[16384, 64, 2.0e14]])
    # At half the rate the attention's seconds come again: it is most of such a step (~90%).
    attention = short - both
    assert 0.8 * both < attention < both, (both, short)
    assert step([[16384, 64, 4.0e14], [32768, 64, 2.0e14]]) == pytest.approx(short)


def test_a_hugging_face_block_is_traced_in_the_engines_compute_dtype_and_lora_freezes_its_base():
    # A bf16 engine's HF block was traced with fp32 weights and priced at fp32's matmul rate (a lent
    # H200's 251 ms step predicted at 2.7 s); a LoRA run's base was traced with weight gradients.
    llama = "{model_type: llama, hidden_size: 64, intermediate_size: 96, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 128}"
    hf = planning_spec(load_config([], ["model.source=hf", f"model.hf_config={llama}"]))
    work = block_work(hf, 1, 32, "pure16")
    matmuls = [c for p in (work.forward, work.backward) for c in p.of("matmul")]
    assert matmuls and {c.dtype for c in matmuls} == {"bfloat16"}
    lora = planning_spec(load_config([], ["model.source=hf", f"model.hf_config={llama}", "model.lora={r: 4}"]))
    full, frozen = (sum(c.count for c in block_work(s, 1, 32, "pure16").backward.of("matmul")) for s in (hf, lora))
    assert frozen < full  # no weight gradients: the inputs' gradients alone
    # Its attention as the run's: transformers skips the mask for one unpadded sequence a row and
    # SDPA runs its causal kernel (half the square); the trace had read fake position ids as packed
    # sequences and traced a masked kernel over the whole square (the HF path's attention at 2x).
    from torch.utils._python_dispatch import TorchDispatchMode

    ran: list[bool] = []

    class Attention(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if "scaled_dot_product" in str(func):
                ran.append(
                    bool(
                        dict(zip(("q", "k", "v", "dropout_p", "is_causal"), args)).get(
                            "is_causal", (kwargs or {}).get("is_causal")
                        )
                    )
                )
            return func(*args, **(kwargs or {}))

    model = hf._build(hf._one_layer())
    with Attention(), torch.no_grad():
        model(torch.zeros(1, 32, dtype=torch.long))
    (traced,) = work.forward.of("attention")
    assert ran == [True] and traced.shape[4] == 1, (ran, traced.shape)


def test_a_gpus_engine_hooks_cost_a_small_models_step_and_hide_behind_a_large_ones():
    # A GPU table's engine probe (zero3: 1 ms of host per parameter tensor, made up for the test):
    # the host queues kernels ahead, so the hooks show where the host's work outlasts the kernels
    # (the small preset at 512 tokens) and hide behind a 1b micro-batch's 16k tokens of matmuls.
    from scaletrain.planning.clock import engines

    per = {"zero3": {"per": 38, "forward_backward_s": 1e-3, "step_s": 1e-4}}
    with_hooks, without = _rates_with({"engines": per}), _rates_with({"measured": "2026-11-29"})

    def hooks(overrides: list[str]) -> tuple[float, float, int]:
        cfg = load_config([], ["parallel.strategy=zero3", "precision=bf16", *overrides])
        model = planning_spec(cfg)
        s = setups_for(cfg, 1, 1, False, model)[0]
        mb = micro_batch(model, s, with_hooks, False)
        a = engines.engine_work(model, s, with_hooks, mb, 1, 1)
        b = engines.engine_work(model, s, without, mb, 1, 1)
        assert any("not in the h200 table" in n for n in b.notes)
        return a.forward + a.backward - b.forward - b.backward, a.optimizer - b.optimizer, len(model.counts().numels)

    small, step, tensors = hooks(["model.preset=small", "data.seq_len=256", "train.micro_batch=2"])
    assert small == pytest.approx(tensors * 1e-3) and step == pytest.approx(tensors * 1e-4)
    large, _, tensors = hooks(["model.preset=1b", "data.seq_len=2048", "train.micro_batch=8"])
    assert large < 0.05 * tensors * 1e-3


def test_a_compiled_chunked_loss_is_priced_fused_and_a_plain_one_eager():
    # Under train.compile the chunked loss's chunks are compiled kernels too (models/loss.py):
    # the head then moves the logits about once forward and their gradient once backward (~7 bytes
    # per logit in the trace) instead of eager's ~67 (the upcasts, the exponential, the one-hot,
    # each a pass over the chunk in fp32). A plain loss (no chunks) is never compiled.
    rates = _rates_with({})

    def head_s(compiled: bool, chunk: int) -> float:
        overrides = ["model.preset=1b", "model.vocab_size=128256", "data.seq_len=2048", "train.micro_batch=8",
                     "precision=bf16", f"train.compile={str(compiled).lower()}", f"train.loss_chunk_tokens={chunk}"]  # fmt: skip
        cfg = load_config([], overrides)
        model = planning_spec(cfg)
        s = setups_for(cfg, 1, 1, False, model)[0]
        mb = micro_batch(model, s, rates, compiled)
        return mb.forward + mb.backward - model.n_blocks * _block_s(model, s, rates, compiled)

    logits = 8 * 2048 * 128256
    saved = head_s(False, 2048) - head_s(True, 2048)
    # about 60 bytes per logit saved at the datasheet's bandwidth: bounds either side of it
    bw = rates.memory_bw
    assert 40 * logits / bw < saved < 80 * logits / bw, saved
    assert head_s(True, 0) == pytest.approx(head_s(False, 0))


def _block_s(model, s: Setup, rates: rates_module.Rates, compiled: bool) -> float:
    from scaletrain.planning.clock.compute import price, traced_size
    from scaletrain.planning.memory import regime

    size = traced_size(s.micro_batch, s.local_seq_len)
    work = block_work(model, size.micro_batch, size.seq_len, regime(s.strategy, s.precision))
    return sum(price(p, rates, compiled, size.tokens, size.attention).seconds for p in (work.forward, work.backward))


def test_a_kernel_the_clock_has_no_rate_for_is_said():
    # data.document_mask runs FlexAttention, which no table measures: priced as SDPA's causal kernel, said.
    cfg = load_config([], ["model.preset=tiny", "data.document_mask=true"])
    model = planning_spec(cfg)
    s = setups_for(cfg, 1, 1, False, model)[0]
    notes = step_time(model, s, cfg, H100, 1).notes
    assert any(n.startswith("data.document_mask: FlexAttention") and "\n" not in n for n in notes), notes
    plain = load_config([], ["model.preset=tiny"])
    assert not any("FlexAttention" in n for n in step_time(model, s, plain, H100, 1).notes)


def test_a_pinned_attention_kernel_is_priced_at_its_own_rows_or_said():
    # train.attention_kernel=flash keeps FlashAttention's rate where cuDNN's is faster; =cudnn takes
    # cuDNN's; a kernel no table measures (math) is priced as FlashAttention and the plan says so.
    rows, cudnn = [[2048, 64, 1.0e14]], [[2048, 64, 2.0e14]]
    rates = _rates_with(
        {"attention": {"forward": rows, "backward": rows, "heads": "...", "cudnn": {"forward": cudnn, "backward": cudnn}}}
    )
    call = rates_module.Call("aten._scaled_dot_product_flash_attention_backward.default", "attention", "", 1e12, 0, 1,
                             (512, 2048, 2048, 64, 1))  # fmt: skip
    assert [rates.call(call, None, k) for k in ("auto", "flash", "cudnn", "math")] == pytest.approx([5e-3, 1e-2, 5e-3, 1e-2])
    assert rates.has_attention("cudnn") and rates.has_attention("flash") and not rates.has_attention("math")
    cfg = load_config([], ["model.preset=tiny", "train.attention_kernel=math"])
    model = planning_spec(cfg)
    s = setups_for(cfg, 1, 1, False, model)[0]
    assert any(n.startswith("train.attention_kernel=math: no rate measured") for n in step_time(model, s, cfg, H100, 1).notes)


def test_a_matmul_is_priced_at_the_rate_of_the_layout_its_pass_runs_it_in():
    # nn.Linear's forward multiplies by a transposed weight ("nt"), its weight gradient by a
    # transposed activation ("tn"), its input gradient row-major ("nn"): the traced block says so.
    spec = planning_spec(load_config([], ["model.preset=tiny"]))
    work = block_work(spec, 1, 64, "pure16")
    forward = {matmul_layout(c.op, c.args) for c in work.forward.of("matmul")}
    backward = sorted(matmul_layout(c.op, c.args) for c in work.backward.of("matmul"))
    assert forward == {"nt"} and set(backward) == {"nn", "tn"} and backward.count("nn") == backward.count("tn")
    # addmm's operands follow its bias; a call without its traced arguments is taken as row-major.
    t = lambda shape, stride: {"t": [shape, stride, "float32"]}  # noqa: E731
    addmm = json.dumps([[t([2], [1]), t([4, 8], [8, 1]), t([8, 2], [1, 8])], {}])
    assert matmul_layout("aten.addmm.default", addmm) == "nt" and matmul_layout("aten.mm.default", "") == "nn"
    # A table with rows by layout prices each call at its layout's row; the row-major rows price
    # a layout it did not measure, and every call of a table without them (the first H200 table).
    # (each call's FLOPs made large enough that its rate, not the launch, prices it)
    nt = replace(next(c for c in work.forward.of("matmul")), flops=1e12)
    nn, tn = (
        replace(next(c for c in work.backward.of("matmul") if matmul_layout(c.op, c.args) == layout), flops=1e12)
        for layout in ("nn", "tn")
    )
    plain = {"matmul": {"bfloat16": [[64, 128, 128, 4e14]]}}
    laid = {**plain, "matmul_layout": {"bfloat16": {"nt": [[64, 128, 128, 6e14]]}}}
    assert [c.dtype for c in (nt, nn, tn)] == ["bfloat16"] * 3
    for c in (nt, nn, tn):
        assert _rates_with(plain).call(c) == pytest.approx(1e12 / 4e14)
    assert _rates_with(laid).call(nt) == pytest.approx(1e12 / 6e14)
    assert _rates_with(laid).call(nn) == pytest.approx(1e12 / 4e14)
    assert _rates_with(laid).call(tn) == pytest.approx(1e12 / 4e14)


def test_a_hybrid_shard_group_inside_a_node_gathers_over_nvlink():
    from scaletrain.planning.clock import engines

    cfg = load_config([], ["model.preset=8b", "data.seq_len=4096", "precision=bf16", "train.micro_batch=1"])
    model, h100 = planning_spec(cfg), gpu("h100", "80GiB")
    rates = rates_for(h100, 8)

    def gathers(s: Setup, per_node: int, nodes: int) -> float:
        work = engines.engine_work(model, s, rates, micro_batch(model, s, rates, False), per_node, nodes)
        return sum(t for label, t in work.largest["comm"] if label.startswith("FSDP's all-gathers"))

    one_node = gathers(Setup("fsdp", 8, 1, 4096, "bf16"), 8, 1)
    # Hybrid 2 x 8 on 2 nodes: each replica's 8 shards on one node, its gathers those of fsdp on that node alone.
    assert gathers(Setup("fsdp", 16, 1, 4096, "bf16", dp_replicate=2), 8, 2) == pytest.approx(one_node)
    # fsdp over both nodes gathers across them (16 shards, 8 NICs a node): a different price.
    assert gathers(Setup("fsdp", 16, 1, 4096, "bf16"), 8, 2) != pytest.approx(one_node)


def test_the_optimizer_is_timed_as_the_engines_step_it(monkeypatch):
    """measure.optimizer_seconds runs the engines' step (optim/optimizers.py skip_where with the
    norm's finiteness, a fused optimizer's found_inf), not a bare optimizer.step(): on a CPU the
    skip path is a per-tensor pass of its own (1.1 ms of the tiny preset's 2.8)."""
    from scaletrain.optim import optimizers
    from scaletrain.planning.clock import measure

    seen = []
    real = optimizers.skip_where

    def recording(opt, skipped):
        seen.append((skipped.dtype, skipped.dim()))
        real(opt, skipped)

    monkeypatch.setattr(optimizers, "skip_where", recording)
    assert measure.optimizer_seconds(4096, 4) > 0
    assert seen and all(s == (torch.bool, 0) for s in seen)
