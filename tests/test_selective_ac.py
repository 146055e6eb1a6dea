"""Selective activation checkpointing (parallel.ac_mode=selective, models/selective_ac.py): the
engines' blocks recompute in backward exactly the operations the planner prices as repeated,
and keep what it counts as kept.

The gradients it gives are checked against one process in tests/test_gradients.py (fsdp,
fsdp + tp 2, zero3); its measured peak against the plan's in tests/test_plan_measure.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scaletrain.config import load_config
from scaletrain.engines.block_wrappers import apply_activation_checkpointing
from scaletrain.errors import UserError
from scaletrain.models import build_model, model_spec, resolve_shape
from scaletrain.planning.clock.trace import block_work
from scaletrain.planning.setup import Setup

pytestmark = pytest.mark.unit

SEQ = 32
MODEL = ["model.preset=tiny", "model.vocab_size=256", f"data.seq_len={SEQ}", "model.tie_embeddings=false"]


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str) -> Counter[str]:
    """The aten operations one backward of the whole model dispatches, its blocks wrapped
    as `mode` says ("none", "full", "selective")."""
    cfg = load_config([], MODEL)
    model = build_model(resolve_shape(cfg.model), SEQ, seed=0)
    if mode != "none":
        apply_activation_checkpointing(model.layers, selective=mode == "selective")
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    loss = model(tokens).float().square().mean()
    ops = _Ops()
    with ops:
        loss.backward()
    return ops.seen


def test_a_selective_block_recomputes_what_the_planner_prices_as_repeated():
    none, full, selective = (_backward_ops(m) for m in ("none", "full", "selective"))
    cfg = load_config([], MODEL)
    spec = model_spec(cfg, None)
    traced = block_work(spec, 1, SEQ, "fp32", torch.bfloat16)
    blocks = resolve_shape(cfg.model).n_layers

    def products(p):
        return sum(c.count for c in p.calls if c.op == "aten.mm.default")

    # 7 products a block: wq, wk, wv, wo, w1, w3, w2. Full checkpointing repeats them up to
    # the last tensor the backward reads (torch's early stop: w2's output is read by nobody's
    # backward, so w2 and the residual add do not run again): 6; selective, of those, every
    # second one: wk, wo and w3.
    assert products(traced.forward) == 7
    assert full["mm"] - none["mm"] == blocks * products(traced.recompute) == blocks * 6
    assert selective["mm"] - none["mm"] == blocks * products(traced.selective) == blocks * 3

    # Every kind of kernel the planner prices as repeated (the memory-bound work, the attention
    # kernel under full only: selective keeps its output) runs again as many times per block.
    def kinds(p):
        out: Counter[str] = Counter()
        for c in p.calls:
            out[c.op.split(".")[1]] += c.count
        return out

    for ran, priced in ((full, traced.recompute), (selective, traced.selective)):
        want = kinds(priced)
        for op in kinds(traced.forward):
            assert ran[op] - none[op] == blocks * want[op], (op, ran[op] - none[op], want[op])
    assert kinds(traced.recompute)["_scaled_dot_product_flash_attention_for_cpu"] == 1
    assert kinds(traced.selective)["_scaled_dot_product_flash_attention_for_cpu"] == 0


def test_what_a_selective_block_keeps_lies_between_its_input_and_everything():
    cfg = load_config([], MODEL)
    spec = model_spec(cfg, None)
    shape = resolve_shape(cfg.model)
    traced = block_work(spec, 1, SEQ, "fp32", torch.bfloat16)
    # Kept: the outputs of wq (dim wide), wv (kv_heads x head_dim), w1 (ffn wide), w2 (dim)
    # and the attention's output (dim) and log-sum-exp (a float per head and position), fp32.
    head_dim = shape.dim // shape.n_heads
    want = SEQ * 4 * (shape.dim + shape.n_kv_heads * head_dim + shape.ffn_dim + shape.dim + shape.dim + shape.n_heads)
    assert traced.selective_saved == want
    from scaletrain.planning.memory import estimate

    def activations(**changes):
        s = Setup(strategy="ddp", dp=1, micro_batch=4, seq_len=SEQ, precision="fp32", **changes)
        return estimate(spec, s).activations

    plain, full, selective = (
        activations(),
        activations(activation_checkpointing=True),
        activations(activation_checkpointing=True, selective=True),
    )
    assert full < selective < plain
    assert selective - full == pytest.approx(shape.n_layers * 4 * want, rel=1e-6)


def test_selective_needs_checkpointing_on():
    with pytest.raises(UserError, match="parallel.ac_mode=selective chooses what activation checkpointing recomputes"):
        load_config([], ["parallel.ac_mode=selective"])
    assert (
        load_config([], ["parallel.ac_mode=selective", "parallel.activation_checkpointing=true"]).parallel.ac_mode == "selective"
    )
