"""train.attention_kernel (training/attention_kernel.py): which of SDPA's kernels the run's
attention uses. On a GPU `auto` measures FlashAttention against cuDNN's at the run's shape and
puts the faster first; here (no GPU) the choice's rule, the priority it sets, the kernel that
then runs, the call it measures (as the model lays it out) and the run's line are checked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode

from scaletrain.config import load_config
from scaletrain.planning import planning_spec
from scaletrain.training import attention_kernel as ak

pytestmark = pytest.mark.unit


def test_the_faster_kernel_wins_only_by_a_margin_and_flash_where_nothing_else_ran():
    assert ak.faster({"flash": 1.0, "cudnn": 0.6})[0] == "cudnn"
    assert "1.67x FlashAttention" in ak.faster({"flash": 1.0, "cudnn": 0.6})[1]
    assert ak.faster({"flash": 1.0, "cudnn": 0.97})[0] == "flash"  # within the timing's spread: torch's choice
    assert ak.faster({"flash": 0.5, "cudnn": 1.0})[0] == "flash"
    assert ak.faster({"flash": 1.0, "cudnn": None})[0] == "flash"  # cuDNN cannot run this shape
    assert ak.faster({"flash": None, "cudnn": 1.0})[0] == "cudnn"
    assert ak.faster({"flash": None, "cudnn": None})[0] == "flash"


def test_the_chosen_kernel_goes_first_and_torchs_order_follows():
    assert ak.order("cudnn") == [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    assert ak.order("flash")[0] == SDPBackend.FLASH_ATTENTION and len(ak.order("flash")) == 4


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _attention_ops() -> list[str]:
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    with _Ops() as ops:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    return ops.names


def _world(device: str = "cpu") -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device), is_main=True, distributed=False)


def test_a_named_kernel_is_put_first_on_a_gpu_and_torchs_order_comes_back_after():
    cfg = load_config([], ["model.preset=tiny", "train.attention_kernel=efficient"])
    before = torch._C._get_sdp_priority_order()
    said: list[str] = []
    with ak.attention_kernel(cfg, planning_spec(cfg), 1, _world("cuda"), said.append) as kernel:  # type: ignore[arg-type]
        assert kernel == "efficient" and said == ["attention: SDPA's efficient kernel first (train.attention_kernel)"]
        assert torch._C._get_sdp_priority_order()[:2] == [int(SDPBackend.EFFICIENT_ATTENTION), int(SDPBackend.FLASH_ATTENTION)]
    assert torch._C._get_sdp_priority_order() == before


def test_a_cpu_keeps_its_own_kernel_and_says_so_where_one_was_named():
    # torch's CPU SDPA takes no priority: its flash kernel wherever it applies.
    cfg = load_config([], ["model.preset=tiny", "train.attention_kernel=math"])
    said: list[str] = []
    with ak.attention_kernel(cfg, planning_spec(cfg), 1, _world(), said.append) as kernel:  # type: ignore[arg-type]
        assert kernel == "" and any("flash_attention" in n for n in _attention_ops())
    assert said == ["attention: train.attention_kernel=math orders a GPU's kernels; this CPU's SDPA chooses its own"]


def test_auto_on_a_cpu_leaves_torchs_order_and_says_nothing():
    cfg = load_config([], ["model.preset=tiny"])
    said: list[str] = []
    before = torch._C._get_sdp_priority_order()
    with ak.attention_kernel(cfg, planning_spec(cfg), 1, _world(), said.append) as kernel:  # type: ignore[arg-type]
        assert kernel == "" and said == [] and torch._C._get_sdp_priority_order() == before


def test_auto_on_a_gpu_measures_at_the_runs_call_and_applies_rank_0s_choice(monkeypatch):
    # No GPU here: the measurement is replaced, the rest runs as on one (the traced call, the
    # choice said and set first).
    cfg = load_config([], ["model.preset=tiny", "train.micro_batch=4", "data.seq_len=64", "precision=bf16"])
    asked: list[tuple] = []

    def measured(kernel: str, call: ak.AttentionCall, dtype: torch.dtype, device: torch.device) -> float | None:
        asked.append((kernel, call, dtype))
        return {"flash": 2e-3, "cudnn": 1e-3}[kernel]

    monkeypatch.setattr(ak, "time_kernel", measured)
    compared: list[tuple] = []
    monkeypatch.setattr(ak, "same_result", lambda *a: compared.append(a) or True)
    said: list[str] = []
    spec = planning_spec(cfg)
    run = ak.AttentionCall.contiguous((4, spec.shape.n_heads, 64, spec.shape.head_dim), spec.shape.n_kv_heads)
    with ak.attention_kernel(cfg, spec, 1, _world("cuda"), said.append) as kernel:  # type: ignore[arg-type]
        assert kernel == "cudnn" and torch._C._get_sdp_priority_order()[0] == int(SDPBackend.CUDNN_ATTENTION)
    assert {a[0] for a in asked} == {"flash", "cudnn"}
    assert {a[1:] for a in asked} == {(run, torch.bfloat16)}
    assert [a[:4] for a in compared] == [("cudnn", "flash", run, torch.bfloat16)]
    assert said == ["attention: SDPA's cudnn kernel first (2.00x FlashAttention's speed at this call (measured))"]


def test_a_kernel_measured_here_takes_time_and_one_this_device_lacks_is_none():
    call = ak.AttentionCall.contiguous((1, 2, 32, 8))
    assert (ak.time_kernel("flash", call, torch.float32, torch.device("cpu")) or 0) > 0
    assert ak.time_kernel("cudnn", call, torch.float32, torch.device("cpu")) is None
    # The grouped-query call as the model makes it (fewer key and value heads, enable_gqa).
    assert (ak.time_kernel("flash", ak.AttentionCall.contiguous((2, 4, 32, 8), 2), torch.float32, torch.device("cpu")) or 0) > 0


def test_the_call_is_the_traced_blocks_for_the_built_in_model_and_a_hugging_face_one():
    # Query, key and value as each model hands them to SDPA: its heads a transposed view of
    # [batch, sequence, heads, head size], and grouped-query attention's fewer key and value heads.
    tiny = planning_spec(load_config([], ["model.preset=tiny"]))
    s = tiny.shape
    assert s.n_kv_heads < s.n_heads
    call = ak.traced_call(tiny, 2, 64, "ddp", "fp32")
    assert call == ak.AttentionCall.contiguous((2, s.n_heads, 64, s.head_dim), s.n_kv_heads)
    assert call.gqa and call.q[1] == (64 * s.n_heads * s.head_dim, s.head_dim, s.n_heads * s.head_dim, 1)
    llama = "{model_type: llama, hidden_size: 64, intermediate_size: 96, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 128}"
    hf = planning_spec(load_config([], ["model.source=hf", f"model.hf_config={llama}"]))
    assert ak.traced_call(hf, 2, 32, "fsdp", "bf16") == ak.AttentionCall.contiguous((2, 4, 32, 16), 2)
    # The tensors built for the measurement have the call's layout.
    q, k, _ = call.tensors(torch.float32, torch.device("cpu"))
    assert (q.shape, q.stride()) == call.q and (k.shape, k.stride()) == call.k


def test_a_kernel_that_cannot_take_the_call_leaves_flash_and_is_named():
    kernel, why = ak.faster({"flash": 1e-3, "cudnn": None})
    assert kernel == "flash" and why == "torch's choice; measured flash 1.00 ms; cudnn cannot run this call"


def test_a_faster_kernel_that_computes_something_else_is_not_taken(monkeypatch):
    # Two real CPU kernels (flash and math) agree to bf16's roundings; a kernel that drops the
    # causal mask does not, and auto keeps FlashAttention, saying why.
    shape = ak.AttentionCall.contiguous((1, 4, 64, 16))
    assert ak.same_result("math", "flash", shape, torch.float32, torch.device("cpu"))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def unmasked(*args, **kwargs):  # the plant: the mask dropped where "cudnn" is asked for
        if torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled():
            kwargs["is_causal"] = False
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", unmasked)
    assert not ak.same_result("math", "flash", shape, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(ak, "time_kernel", lambda kernel, *a: {"flash": 2e-3, "cudnn": 1e-3}[kernel])
    monkeypatch.setattr(ak, "same_result", lambda *a: False)
    assert ak.choose(shape, torch.bfloat16, torch.device("cuda")) == (
        "flash", "cudnn's was faster but its result differed from FlashAttention's at this call",
    )  # fmt: skip


def test_two_correct_kernels_agree_to_bf16s_roundings():
    # The tolerance's claim in bf16, what GPUs train in: torch's CPU flash kernel against its math
    # path. Under ATEN_CPU_CAPABILITY=default or avx2 on an AMX CPU torch's bf16 flash kernel
    # itself fails ("pack_vnni2 is only supported when avx512 is supported"): nothing to compare.
    for shape in (ak.AttentionCall.contiguous((1, 4, 64, 16)), ak.AttentionCall.contiguous((2, 8, 256, 64), 2)):
        try:
            agree = ak.same_result("math", "flash", shape, torch.bfloat16, torch.device("cpu"))
        except RuntimeError as e:
            if "pack_vnni2" not in str(e):
                raise
            pytest.skip(f"torch's bf16 CPU flash kernel under this capability: {e}")
        assert agree, shape
