"""train.float8 on a CPU: which Linear layers torchao converts (meta-device models, the 1b
preset's shape included), that names and state keep their form through the real engines,
where the config and the device refuse it, and the planner's float8 figures, its clock
pricing the block as traced with the converted layers. Float8 training on this CPU, for real
(torch 2.13 runs torch._scaled_mm there): tests/test_float8_cpu.py."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from scaletrain.config import load_config
from scaletrain.config.float8 import float8_device_problem
from scaletrain.engines.float8 import apply_float8, convert
from scaletrain.errors import UserError
from scaletrain.models import model_spec
from scaletrain.models.float8 import cpu_float8_matmul
from scaletrain.planning import make_plan
from scaletrain.planning.clock.compute import micro_batch
from scaletrain.planning.clock.rates import rates_for
from scaletrain.planning.clock.step import step_time
from scaletrain.planning.clock.trace import block_work
from scaletrain.planning.float8 import CAST_16, CAST_32, cast_bytes, converted, plannable
from scaletrain.planning.hardware import KNOWN_GPUS, gpu, this_cpu
from scaletrain.planning.memory import engine_buffers, estimate
from scaletrain.planning.planner import comm_bytes_per_step
from scaletrain.planning.setup import Setup

from helpers.launch import probe

H100 = gpu("h100", None)
BLOCK = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
# A mixture of experts whose router (dim 128 -> 16 experts) has float8-sized dimensions, so
# only the rule that a router never converts keeps it out; one dense block, one shared expert.
MOE = ["model.preset=tiny-moe", "model.moe={experts: 16, shared_experts: 1, dense_layers: 1}"]
SHARED = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.shared.w1", "feed_forward.shared.w2")
SHARED += ("feed_forward.shared.w3",)


def spec_of(*overrides: str):
    return model_spec(load_config([], list(overrides)), 1024)


def float8_names(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}


def expected(n_layers: int, per_block, first=None) -> set[str]:
    return {f"layers.{i}.{leaf}" for i in range(n_layers) for leaf in (first if i == 0 and first else per_block)}


CASES = {
    "tiny": (["model.preset=tiny"], expected(4, BLOCK)),
    "small": (["model.preset=small"], expected(6, BLOCK)),
    "1b": (["model.preset=1b"], expected(16, BLOCK)),  # the GPU check's model, on meta: no memory
    "moe": (MOE, expected(4, SHARED, first=BLOCK)),
    # A feed-forward width that is no multiple of 16 (w1, w3: 128 -> 360; w2: 360 -> 128).
    "odd": (["model.preset=tiny", "model.ffn_dim=360"], expected(4, BLOCK[:4])),
}


@pytest.mark.unit
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_blocks_linears_convert_and_nothing_else(case, fsdp):
    overrides, want = CASES[case]
    spec = spec_of(*overrides)
    model = spec.build_meta(64)
    params = list(model.named_parameters())
    keys = list(model.state_dict())
    convert(model, spec, fsdp)
    assert float8_names(model) == want
    assert isinstance(model.tok_embeddings, nn.Embedding)
    assert type(model.output) is nn.Linear  # the head stays bf16
    for moe in (m for m in model.modules() if hasattr(m, "router")):
        assert type(moe.router) is nn.Linear
    # The same names (checkpoints, resharding and exports key on them) and shapes; without
    # FSDP's float8 all-gather the very same Parameter objects (under it, a Parameter of
    # torchao's subclass around the same tensor).
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in params]
    assert list(model.state_dict()) == keys
    if not fsdp:
        assert [id(p) for _, p in model.named_parameters()] == [id(p) for _, p in params]


@pytest.mark.unit
@pytest.mark.parametrize(
    "override, words",
    [
        ("parallel.strategy=zero2", ["parallel.strategy=ddp or fsdp, not zero2", "accepted: parallel.strategy=ddp|fsdp"]),
        ("precision=fp32", ["precision=fp32", "accepted: precision=bf16"]),
        ("precision=fp16", ["precision=fp16", "accepted: precision=bf16"]),
        ("parallel.tp=2", ["parallel.tp=2", "accepted: parallel.tp=1"]),
        ("model.source=hf", ["model.source=hf", "accepted: model.source=builtin"]),
    ],
)
def test_the_config_refuses_in_one_line(override, words):
    base = ["train.float8=true", "precision=bf16", "parallel.strategy=fsdp"]
    if override == "model.source=hf":
        override = "model.source=hf"
        base.append("model.hf_config={model_type: llama}")
    with pytest.raises(UserError) as e:
        load_config([], [*base, override])
    msg = str(e.value)
    assert "\n" not in msg and "train.float8=true" in msg and "train.float8=false" in msg, msg
    for w in words:
        assert w in msg, msg


@pytest.mark.unit
def test_the_config_accepts_ddp_and_fsdp_in_bf16():
    # auto too: the planner then chooses among float8's layouts (tests/test_train_planning.py).
    for strategy in ("ddp", "fsdp", "auto"):
        cfg = load_config([], ["train.float8=true", "precision=bf16", f"parallel.strategy={strategy}", "train.compile=true"])
        assert cfg.train.float8
    assert not load_config([], []).train.float8  # off unless asked


@pytest.mark.unit
def test_the_device_must_have_float8_matmuls(monkeypatch):
    # A CPU whose torch runs torch._scaled_mm there (2.13 does: this suite's) trains in float8;
    # one with an older torch is refused in one line.
    assert float8_device_problem("cpu", None, "cpu", cpu_float8=True) is None
    cpu = float8_device_problem("cpu", None, "cpu")
    assert cpu and "this run's device is cpu" in cpu and "train.float8=false" in cpu and "\n" not in cpu
    assert cpu_float8_matmul()  # this suite's torch is pyproject.toml's pin, 2.13
    a100 = float8_device_problem("cuda", (8, 0), "NVIDIA A100-SXM4-80GB")
    assert a100 and "NVIDIA A100-SXM4-80GB has 8.0" in a100 and "8.9" in a100
    assert float8_device_problem("cuda", (8, 9), "NVIDIA L40S") is None  # Ada
    assert float8_device_problem("cuda", (9, 0), "NVIDIA H100 80GB HBM3") is None
    assert "ROCm" in (float8_device_problem("cuda", (9, 4), "AMD Instinct MI300X", hip=True) or "")
    # The engines' entry: a CPU without float8 matmuls refused before torchao is imported.
    monkeypatch.setattr("scaletrain.engines.float8.cpu_float8_matmul", lambda: False)
    with pytest.raises(UserError, match="this run's device is cpu"):
        apply_float8(spec_of().build_meta(8), spec_of(), torch.device("cpu"), fsdp=True)


@pytest.mark.unit
def test_without_torchao_one_line_names_the_extra(monkeypatch):
    for name in ("torchao", "torchao.float8", "torchao.float8.float8_linear"):
        monkeypatch.setitem(sys.modules, name, None)  # `import torchao...` now fails as if absent
    spec = spec_of()
    with pytest.raises(UserError) as e:
        convert(spec.build_meta(8), spec, fsdp=False)
    assert str(e.value) == (
        "train.float8=true needs torchao; accepted: pip install 'scaletrain[float8]' (torchao==0.18.0), or train.float8=false"
    )


@pytest.mark.dist
def test_state_through_the_engines_keeps_names_and_plain_tensors(tmp_path):
    (r,) = probe("float8_checkpoint", [], tmp_path)
    for strategy in ("ddp", "fsdp"):
        got = r[strategy]
        assert got["converted"] == sorted(expected(2, BLOCK)), got
        assert got["same_keys"] and got["plain_tensors"] and got["same_init"], got
    assert r["fsdp"]["weight_type"] == "WeightWithDynamicFloat8CastTensor"  # all-gathered in float8
    assert r["ddp"]["weight_type"] == "Parameter"
    assert r["step"] == {"optimizer_plain": True, "moments": 20 * 2, "scales": 14}, r["step"]
    assert r["f8_into_plain"] and r["plain_into_f8"], r
    # The float8 run's checkpoint reads where torchao is not even installed: torch.load's
    # weights_only (DCP's reader) refuses torchao's tensor subclass, which must not be in it.
    read = (
        "import sys, torch; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as c; "
        f"c({str(tmp_path / 'f8')!r}, {str(tmp_path / 'f8.pt')!r}); "
        f"sd = torch.load({str(tmp_path / 'f8.pt')!r}, weights_only=True); "
        "assert 'torchao' not in sys.modules; print(type(sd['model']['layers.0.attention.wq.weight']).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "Tensor", done.stderr[-2000:]


# ----------------------------------------------------------------------------- the planner


def one_gpu(spec, strategy: str, float8: bool, dp: int = 1, **kw) -> Setup:
    return Setup(strategy=strategy, dp=dp, micro_batch=4, seq_len=2048, precision="bf16", float8=float8, **kw)


@pytest.mark.unit
def test_the_1b_models_converted_weights_and_flops():
    spec = spec_of("model.preset=1b")
    c = converted(spec)
    per_block = 2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192  # wq, wo; wk, wv (8 kv heads); w1, w3, w2
    assert (c.params, c.block_params) == (16 * per_block, per_block)
    assert c.flops_per_token == 6 * 16 * per_block
    assert c.in_features == 16 * (4 * 2048 + 2 * 2048 + 8192) and c.out_features == 16 * (2 * 2048 + 2 * 512 + 2 * 8192 + 2048)


@pytest.mark.unit
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_clock_traces_the_float8_block(strategy):
    """The clock prices a float8 layout from its block traced with torchao's Float8Linear
    layers: each converted Linear's three products as torch._scaled_mm at its own shape (e4m3
    operands in forward, the output gradient in e5m2 in backward), in place of the bf16 block's
    products, and the casts as the memory-bound operations they are."""
    spec = spec_of("model.preset=1b")
    reg = "autocast" if strategy == "ddp" else "pure16"
    f8, bf = block_work(spec, 1, 2048, reg, torch.bfloat16, float8=True), block_work(spec, 1, 2048, reg, torch.bfloat16)
    linears = [(2048, 2048), (2048, 512), (2048, 512), (2048, 2048), (2048, 8192), (8192, 2048), (2048, 8192)]  # (in, out)

    def products(p, op):
        return sorted((c.shape[1:4], c.dtype) for c in p.calls if c.op == op for _ in range(c.count))

    # Forward: x [2048, in] @ W.T [in, out] per converted Linear, every one of them float8.
    assert products(f8.forward, "aten._scaled_mm.default") == sorted(((2048, o, i), "float8_e4m3fn") for i, o in linears)
    assert products(f8.forward, "aten.mm.default") == []
    want = [((2048, i, o), "float8_e5m2") for i, o in linears]  # the input gradient: dY [2048, out] @ W [out, in]
    want += [((o, i, 2048), "float8_e5m2") for i, o in linears]  # the weight gradient: dY.T [out, 2048] @ X [2048, in]
    assert products(f8.backward, "aten._scaled_mm.default") == sorted(want)
    flops = lambda p, kind: sum(c.flops * c.count for c in p.calls if c.kind == kind)  # noqa: E731
    assert flops(f8.forward, "matmul") == flops(bf.forward, "matmul") and flops(f8.backward, "matmul") == flops(
        bf.backward, "matmul"
    )
    # The casts: each converted Linear's input, weight and output gradient read for its amax and
    # cast, passes of memory the bf16 block does not make.
    moved = lambda p: sum(c.nbytes * c.count for c in p.calls if c.kind == "memory")  # noqa: E731
    assert moved(f8.forward) - moved(bf.forward) > 5 * 2048 * sum(i for i, _ in linears)
    assert f8.forward.dispatched > bf.forward.dispatched


@pytest.mark.unit
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_step_time_prices_the_float8_products_and_says_how(strategy):
    spec = spec_of("model.preset=1b")
    cfg = load_config([], ["model.preset=1b", "precision=bf16", "train.compile=true"])
    s8, s16 = one_gpu(spec, strategy, True), one_gpu(spec, strategy, False)
    t8, t16 = (step_time(spec, s, cfg, H100, 1) for s in (s8, s16))
    assert (H100.peak_flops_8, H100.peak_flops_16, H100.memory_bw) == (1979e12, 989e12, 3.35e12)
    # Compiled, at the float8 peak (no H100 has measured its float8 products: bf16's rate at
    # each shape times 1979 / 989, and the plan says so), the casts fused into their neighbours.
    assert 1.1 < t16.total / t8.total < 1.6  # torchtitan's 8B: 1.28x over bf16 compiled at 8 x H100; the 1b on an H200: 1.17x
    assert any("no float8 matmul measured for h100" in n and "2.0x" in n for n in t8.notes)
    assert not any("float8" in n for n in t16.notes)
    # Eager, torchao's casts are separate kernels (an abs, a max, a multiply, a clamp, a copy per
    # tensor) and their dispatches: slower than bf16, as torchao's own notes say of eager float8.
    eager = load_config([], ["model.preset=1b", "precision=bf16"])
    assert step_time(spec, s8, eager, H100, 1).total > step_time(spec, s16, eager, H100, 1).total


@pytest.mark.unit
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_without_torchao_the_clock_prices_float8_by_the_peaks_and_says_so(strategy, monkeypatch):
    monkeypatch.setattr("scaletrain.planning.clock.compute.float8_traceable", lambda: False)
    spec = spec_of("model.preset=1b")
    cfg = load_config([], ["model.preset=1b", "precision=bf16", "train.compile=true"])
    s8, s16 = one_gpu(spec, strategy, True), one_gpu(spec, strategy, False)
    tokens = 4 * 2048
    t8, t16 = (step_time(spec, s, cfg, H100, 1) for s in (s8, s16))
    # The converted layers are the blocks' matmul weights (their share of the blocks'
    # parameters: all but the norms' gains): at the float8 peak (1979 against 989 TFLOP/s)
    # their matmuls take 989/1979 of the time; the casts give some of it back.
    mb = micro_batch(spec, s16, rates_for(H100), True)
    share = converted(spec).params / (spec.n_blocks * spec.counts().block)
    casts = rates_for(H100).copy(cast_bytes(spec, s8, tokens, compiled=True))
    assert 0.999 < share < 1 and t16.total - t8.total == pytest.approx(mb.matmul_s * share * (1 - 989 / 1979) - casts, rel=1e-9)
    assert any("torchao is not installed" in n for n in t8.notes)
    c = converted(spec)
    weights = CAST_32 * c.params * (2 if strategy == "ddp" else 2 / s8.shard)  # ddp: fwd + bwd; fsdp: per gather
    assert cast_bytes(spec, s8, tokens) == pytest.approx(tokens * CAST_16 * (2 * c.in_features + 2 * c.out_features) + weights)


@pytest.mark.unit
def test_fsdp_all_gathers_and_holds_the_converted_weights_at_one_byte():
    spec = spec_of("model.preset=1b")
    c = converted(spec)
    s8, s16 = one_gpu(spec, "fsdp", True, dp=8), one_gpu(spec, "fsdp", False, dp=8)
    gathers = 2  # forward, and again in backward (resharded after forward)
    assert comm_bytes_per_step(spec, s16, 1) - comm_bytes_per_step(spec, s8, 1) == pytest.approx(7 / 8 * c.params * gathers)
    assert engine_buffers(spec, s16) - engine_buffers(spec, s8) == pytest.approx(2 * c.block_params)  # 2 units gathered
    kept = replace(s8, reshard_after_forward=False)
    assert engine_buffers(spec, replace(kept, float8=False)) - engine_buffers(spec, kept) == pytest.approx(c.params)
    # FSDP's blocks save what a bf16 block saves (torchao keeps the bf16 input for backward).
    assert estimate(spec, s8).activations == estimate(spec, s16).activations


@pytest.mark.unit
def test_on_a_cpu_fsdp_gathers_the_converted_weights_in_bf16():
    # gloo has no float8 dtypes (an all-gather of one fails): engines/fsdp.py gathers them in
    # bf16 on a CPU, and the plan for this CPU counts the same bytes as without float8.
    spec = spec_of("model.preset=small")
    args = ["model.preset=small", "precision=bf16", "parallel.strategy=fsdp", "data.seq_len=256"]
    cpu = this_cpu()
    plans = [
        make_plan(
            load_config([], [*args, f"train.float8={f}"]), spec, 2, 1, cpu, all_strategies=False, as_configured=True, timed=False
        )
        for f in ("true", "false")
    ]
    (c8, c16) = (p.chosen for p in plans)
    assert c8.setup.float8 and not c8.setup.float8_gather
    assert c8.comm_bytes == c16.comm_bytes and c8.memory.buffers == c16.memory.buffers
    # On a GPU (NCCL) the same layout gathers them at 1 byte.
    on_gpu = make_plan(
        load_config([], [*args, "train.float8=true"]), spec, 2, 1, H100, all_strategies=False, as_configured=True, timed=False
    )
    assert on_gpu.chosen.setup.float8_gather and on_gpu.chosen.comm_bytes < c16.comm_bytes


@pytest.mark.unit
def test_ddp_saves_no_16bit_weight_copies_under_float8():
    spec = spec_of("model.preset=1b")
    s8, s16 = one_gpu(spec, "ddp", True), one_gpu(spec, "ddp", False)
    fewer = estimate(spec, s16).activations - estimate(spec, s8).activations
    assert fewer == pytest.approx(16 * converted(spec).block_params * 2)  # a bf16 copy per weight, per block


@pytest.mark.unit
def test_the_plan_shows_float8_beside_bf16_and_only_where_it_runs():
    args = ["model.preset=1b", "data.seq_len=2048", "precision=bf16", "train.float8=true"]
    cfg = load_config([], [*args, "train.compile=true"])
    spec = spec_of("model.preset=1b")
    plan = make_plan(cfg, spec, 8, 1, replace(H100, memory=80 * 2**30))
    assert {c.setup.strategy for c in plan.candidates} == {"ddp", "fsdp"}  # no zero1-3
    # A pipeline runs float8 (each stage's blocks converted: tests/test_float8_cpu.py); tensor parallel does not yet.
    assert plannable(replace(plan.chosen.setup, strategy="fsdp", pp=2)) and not plannable(replace(plan.chosen.setup, tp=2))
    assert all(c.setup.float8 and "float8" in c.setup.label for c in plan.candidates)
    f = plan.as_dict()["float8"]
    assert f["bf16_step_time_s"] > f["step_time_s"] > 0 and f["speedup"] > 1
    assert any(n.startswith("train.float8: ") and "in bf16" in n for n in plan.notes)
    assert all(c["float8"] for c in plan.as_dict()["candidates"])
    assert not any("without train.compile" in n for n in plan.notes)
    # Eager, float8's casts run unfused and bf16 is faster: the plan says so and what to add.
    eager = make_plan(load_config([], args), spec, 8, 1, replace(H100, memory=80 * 2**30))
    assert eager.as_dict()["float8"]["speedup"] < 1
    assert any("slower than bf16 here without train.compile" in n and "train.compile=true" in n for n in eager.notes)
    with pytest.raises(UserError, match="A100 SXM, has none"):
        make_plan(cfg, spec, 8, 1, KNOWN_GPUS["a100"])
