"""A mixture of experts' host synchronisations (tests/sync_counter.py counts them), one
forward and backward of a model of MoE blocks: none on the grouped path, exactly one per
MoE layer and forward on the loop (its split sizes), exactly one per MoE layer and forward
under expert parallelism on either path (the all-to-all's split sizes); an activation-
checkpointing recompute is a forward again. The choice of path: model.moe.experts_impl."""

from __future__ import annotations

import json

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.engines.block_wrappers import apply_activation_checkpointing
from scaletrain.errors import UserError
from scaletrain.models.grouped_mm import _without_sync
from scaletrain.models.moe import MoE
from scaletrain.models.presets import resolve_shape
from scaletrain.models.spec import LlamaSpec
from sync_counter import SyncCounter

from helpers.launch import check, probe_command, run

LAYERS = 2
MODEL = ["model.preset=tiny-moe", f"model.n_layers={LAYERS}", "model.dim=32", "model.n_heads=2", "model.n_kv_heads=2"]
MODEL += ["model.moe.expert_ffn_dim=48"]


def _model(*overrides: str):
    spec = LlamaSpec(resolve_shape(load_config([], [*MODEL, *overrides]).model, 64))
    model = spec.build_meta(16)
    spec.materialize(model, torch.device("cpu"), seed=0)
    return spec, model


def _count(spec, model) -> SyncCounter:
    inputs = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    with SyncCounter() as syncs:
        spec.loss(model(inputs[:, :-1]), inputs[:, 1:]).backward()
    return syncs


@pytest.mark.unit
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "recomputed"])
@pytest.mark.parametrize("capacity", ["0", "0.5"])
@pytest.mark.parametrize("impl", ["grouped", "auto", "loop"])  # auto: grouped on this CPU, after its probe
def test_the_grouped_path_reads_nothing_back_and_the_loop_once_per_layer(impl, capacity, checkpointed):
    spec, model = _model(f"model.moe.experts_impl={impl}", f"model.moe.capacity_factor={capacity}")
    if checkpointed:
        apply_activation_checkpointing(spec.blocks(model))
    # A first pass: what is set up once (the grouped kernel's probe, run here inside a
    # checkpointed forward, which must not change what the forward saves) is not per step.
    _without_sync.cache_clear()
    _count(spec, model)
    syncs = _count(spec, model)
    forwards = LAYERS * (2 if checkpointed else 1)  # the recompute in backward is a forward again
    if impl != "loop":
        assert syncs.sites == [], syncs.sites
    else:
        assert syncs.count == forwards, syncs.sites
        assert {(op, site.split(":")[0]) for op, site in syncs.sites} == {("Tensor.tolist", "scaletrain/models/moe.py")}


@pytest.mark.unit
def test_the_counter_sees_a_planted_read(monkeypatch):
    # What keeps the test above from passing by construction: the same counting, around
    # the grouped path with one .item() planted in it, sees that read where it was made.
    import scaletrain.models.moe as moe

    grouped = moe.grouped_swiglu

    def reading(tokens, *args):
        tokens.sum().item()
        return grouped(tokens, *args)

    monkeypatch.setattr(moe, "grouped_swiglu", reading)
    syncs = _count(*_model("model.moe.experts_impl=grouped"))
    assert [(op, site.split(":")[0]) for op, site in syncs.sites] == [
        ("aten._local_scalar_dense", "scaletrain/models/moe.py")
    ] * LAYERS


@pytest.mark.unit
def test_auto_takes_the_grouped_kernel_on_this_cpu_and_the_loop_for_widths_it_cannot_take():
    # torch 2.13 has the grouped kernel on the CPU (fp32, bf16), so auto takes it here: no
    # host read. A width that is no multiple of 16 bytes falls back to the loop.
    assert _count(*_model()).count == 0
    assert _count(*_model("model.dim=36")).count == 0  # 36 fp32 = 144 bytes = 9 x 16 (bf16 would need 40)
    assert _count(*_model("model.moe.expert_ffn_dim=42")).count == LAYERS  # 42 x 4 = 168 bytes: no multiple of 16


@pytest.mark.unit
def test_experts_impl_takes_three_values_and_grouped_needs_aligned_widths():
    with pytest.raises(UserError) as err:
        load_config([], ["model.preset=tiny-moe", "model.moe.experts_impl=fast"])
    assert "model.moe.experts_impl" in str(err.value) and "'grouped'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="model.moe.experts_impl=grouped needs model.dim=32 and the expert width 42"):
        resolve_shape(load_config([], [*MODEL, "model.moe.expert_ffn_dim=42", "model.moe.experts_impl=grouped"]).model, 64)
    layer = MoE(resolve_shape(load_config([], [*MODEL, "model.moe.experts_impl=loop"]).model, 64))
    assert layer.experts.impl == "loop"


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_expert_parallel_reads_its_split_sizes_once_per_layer_and_forward(tmp_path):
    # Two ranks, each holding 4 of the 8 experts (tests/probes/moe_syncs.py): one read of
    # every split size the two all-to-alls and the local experts need, on either path.
    out = tmp_path / "syncs.json"
    check(run(probe_command("moe_syncs", ["--out", str(out)], nproc=2)))
    counted = json.loads(out.read_text())
    assert counted == {"grouped": LAYERS, "loop": LAYERS, "grouped_recomputed": 2 * LAYERS}, counted
