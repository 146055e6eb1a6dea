"""The profile_steps window (which steps it traces, when it writes) and analyze_trace:
its interval rules on hand-made traces with known answers, and on a real world-2 DDP run
where a peer's late all-reduce must show as this rank's exposed communication."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from scaletrain.telemetry.profile import ProfileWindow, analyze_trace

CPU = torch.device("cpu")


def names(trace: Path) -> Counter[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return Counter(e["name"] for e in events if e.get("ph") == "X")


def train(window: ProfileWindow, steps: range, after_each=None) -> None:
    """A toy model's loop, marked the way the trainer marks its steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in steps:
        window.before_step(step)
        with window.phase("data"):
            x = torch.randn(16, 8)
        with window.phase("forward_backward"):
            model(x).square().mean().backward()
        with window.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        window.after_step(step)
        if after_each:
            after_each(step)


# ---------------------------------------------------------------------------- the window


@pytest.mark.unit
def test_window_traces_exactly_its_steps_and_writes_after_the_last(tmp_path):
    window = ProfileWindow([2, 3], tmp_path / "profile", rank=1, device=CPU)
    trace = tmp_path / "profile" / "rank1.trace.json"
    existed = {}
    train(window, range(1, 6), after_each=lambda step: existed.setdefault(step, trace.exists()))
    window.close()
    assert existed == {1: False, 2: False, 3: True, 4: True, 5: True}  # written as step 3 ends
    assert window.written == trace and window.steps_recorded == [2, 3]
    seen = names(trace)
    assert sorted(n for n in seen if n.startswith("ProfilerStep#")) == ["ProfilerStep#2", "ProfilerStep#3"]
    for phase in ("data", "forward_backward", "optimizer"):
        assert seen[f"scaletrain:{phase}"] == 2, phase
    result = analyze_trace(trace)
    assert result["steps"] == 2 and result["method"] == "cpu" and result["total_s"] > 0
    assert result["comm_s"] == 0 and result["comm_share"] == 0  # one process: nothing to wait for
    assert result["top_ops"] and {"name", "self_s", "count"} <= result["top_ops"][0].keys()
    assert any(op["name"] in ("aten::addmm", "aten::mm") for op in result["top_ops"])


@pytest.mark.unit
def test_window_off_is_inert(tmp_path):
    window = ProfileWindow([], tmp_path / "profile", rank=0, device=CPU)
    assert window.phase("data") is window.phase("optimizer")  # one shared nullcontext: no allocation per call
    train(window, range(1, 4))
    window.close()
    assert not window.active and window.written is None and not (tmp_path / "profile").exists()


@pytest.mark.unit
def test_run_ending_inside_the_window_writes_on_close(tmp_path):
    window = ProfileWindow([2, 10], tmp_path, rank=0, device=CPU)
    train(window, range(1, 4))
    assert window.active and not (tmp_path / "rank0.trace.json").exists()
    window.close()
    assert sorted(n for n in names(tmp_path / "rank0.trace.json") if n.startswith("ProfilerStep#")) == [
        "ProfilerStep#2",
        "ProfilerStep#3",
    ]


@pytest.mark.unit
def test_resumed_inside_the_window_traces_the_rest_of_it(tmp_path):
    window = ProfileWindow([2, 4], tmp_path, rank=0, device=CPU)
    train(window, range(3, 7))  # resumed from the checkpoint of step 2
    assert window.steps_recorded == [3, 4] and not window.active
    assert names(tmp_path / "rank0.trace.json")["scaletrain:optimizer"] == 2


# ---------------------------------------------------------------------------- analysis rules


def x(name: str, ts: float, end: float, tid: Any = 1, cat: str = "cpu_op") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": end - ts}


@pytest.mark.unit
def test_cpu_rule_on_a_hand_made_trace(tmp_path):
    events = [
        # Step 1: a collective enqueued (explicit), then the thread waits with no operator
        # running while gloo works; the wait ends before the collective's event does not matter.
        x("ProfilerStep#1", 0, 1000, cat="user_annotation"),
        x("aten::mm", 0, 300),
        x("c10d::allreduce_", 300, 320),
        x("gloo:all_reduce", 310, 650, tid=2, cat="user_annotation"),
        x("aten::mm", 700, 1000),  # idle 320-700; the collective covers 320-650 of it
        # Between steps: neither the metrics all-reduce nor its wait is the steps' communication.
        x("c10d::allreduce_", 1020, 1040),
        x("gloo:all_reduce", 1030, 1090, tid=2, cat="user_annotation"),
        # Step 2: waits inside a Python hook (an enclosing op's self time) count; a 20 us gap
        # between two operators during the collective is dispatch overhead, not a wait.
        x("ProfilerStep#2", 1100, 1500, cat="user_annotation"),
        x("autograd::engine::evaluate_function: MulBackward0", 1100, 1500),
        x("aten::mul", 1100, 1180),
        x("aten::add", 1200, 1250),
        x("FSDP::post_backward_reduce (layers.0)", 1250, 1500, cat="user_annotation"),
        x("gloo:all_reduce", 1150, 1450, tid=2, cat="user_annotation"),
        # Another thread's operators never make the training thread busy.
        x("aten::copy_", 1300, 1400, tid=2),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = analyze_trace(path)
    assert r["steps"] == 2 and r["method"] == "cpu"
    assert r["total_s"] == pytest.approx(1400e-6)
    assert r["comm_s"] == pytest.approx((650 - 300 + 1450 - 1250) * 1e-6)
    assert r["compute_s"] == pytest.approx(r["total_s"] - r["comm_s"])
    assert r["comm_share"] == pytest.approx(550 / 1400)
    top = {op["name"]: op for op in r["top_ops"]}
    assert top["aten::mm"]["self_s"] == pytest.approx(600e-6) and top["aten::mm"]["count"] == 2
    assert top["autograd::engine::evaluate_function: MulBackward0"]["self_s"] == pytest.approx(270e-6)
    assert [op["name"] for op in r["top_ops"]][0] == "aten::mm"


@pytest.mark.unit
def test_cuda_rule_counts_nccl_kernels_not_hidden_behind_compute(tmp_path):
    events = [
        x("ProfilerStep#5", 0, 1000, cat="user_annotation"),
        x("nccl:all_reduce", 50, 60),  # the CPU-side enqueue: not what the rule measures on CUDA
        x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 100, 500, tid=9, cat="kernel"),  # its own stream
        x("ampere_sgemm_128x64_tn", 0, 300, tid=7, cat="kernel"),
        x("ampere_sgemm_128x64_tn", 450, 600, tid=8, cat="kernel"),  # another stream
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = analyze_trace(path)
    assert r["method"] == "cuda"
    assert r["comm_s"] == pytest.approx(150e-6)  # 300-450: the only NCCL time with no compute kernel
    assert r["comm_share"] == pytest.approx(0.15)
    sgemm = {k["name"]: k for k in r["top_kernels"]}["ampere_sgemm_128x64_tn"]
    assert sgemm["count"] == 2 and sgemm["self_s"] == pytest.approx(450e-6)


@pytest.mark.unit
def test_cuda_trace_splits_device_time_by_kind_and_counts_the_idle_device(tmp_path):
    """What the GPU checklist's MFU runs report (docs/gpu.md): each kind's device seconds in
    the profiled steps, overlaps inside a kind once, and the span with no device work."""
    flash = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t>>"
    events = [
        x("ProfilerStep#5", 0, 1000, cat="user_annotation"),
        x("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", 0, 300, tid=7, cat="kernel"),
        x("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 250, 400, tid=8, cat="kernel"),  # overlaps 50
        x(flash, 400, 500, tid=7, cat="kernel"),  # attention, though its name holds "cutlass"
        x("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 500, 550, tid=7, cat="kernel"),
        x("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", 550, 560, tid=7, cat="kernel"),
        x("Memcpy DtoH (Device -> Pinned)", 560, 570, tid=7, cat="gpu_memcpy"),
        x("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", 700, 900, tid=7, cat="kernel"),
        x("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 850, 950, tid=9, cat="kernel"),
        x("some_kernel_nobody_named", 1500, 1600, tid=7, cat="kernel"),  # after the step: not counted
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = analyze_trace(path)
    us = {k: round(v * 1e6) for k, v in r["kernel_s"].items()}
    assert us == {
        "matmul": 400, "attention": 100, "fused (inductor)": 50, "elementwise, reductions (aten)": 10, "copies": 10,
        "optimizer": 200, "communication": 100,
    }  # fmt: skip
    assert r["gpu_idle_s"] == pytest.approx(180e-6)  # 570-700 and 950-1000: nothing on the device
    assert r["comm_s"] == pytest.approx(50e-6)  # 900-950: NCCL alone


# ---------------------------------------------------------------------------- world 2


# The rule on real multi-rank runs, through the trainer (a late peer is the waiting rank's
# exposed communication; an injected slow link raises the share): tests/test_telemetry.py.
