"""The Llama model, its presets and its arithmetic; small shapes only, so the file runs in seconds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from scaletrain.config import ModelConfig
from scaletrain.errors import UserError
from scaletrain.models import (
    Llama,
    ModelShape,
    build_model,
    count_params,
    flops_per_token,
    loss_fn,
    resolve_shape,
)
from scaletrain.models.llama import apply_rope

pytestmark = pytest.mark.unit

VOCAB = 512
SEQ = 32


def shape(preset: str = "tiny", vocab: int = VOCAB, **overrides) -> ModelShape:
    return resolve_shape(ModelConfig(preset=preset, **overrides), vocab)


@pytest.fixture(scope="module")
def tiny() -> Llama:
    return build_model(shape(), SEQ, seed=0)


def tokens(batch: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# --- forward ----------------------------------------------------------------------------


def test_logits_shape_and_initial_loss(tiny):
    x = tokens(3)
    logits = tiny(x)
    assert logits.shape == (3, SEQ, VOCAB)
    # Small init gives near-uniform predictions: the loss starts near ln(vocab).
    assert abs(loss_fn(logits, tokens(3, seed=1)).item() - math.log(VOCAB)) < 0.1


def test_causal(tiny):
    x = tokens(1)
    t = SEQ // 2
    y = x.clone()
    y[0, t] = (y[0, t] + 1) % VOCAB
    with torch.no_grad():
        a, b = tiny(x), tiny(y)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_shorter_sequences_match_prefix_and_longer_are_refused(tiny):
    x = tokens(2)
    with torch.no_grad():
        full, prefix = tiny(x), tiny(x[:, :5])
    torch.testing.assert_close(prefix, full[:, :5], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny(tokens(1, SEQ + 1))


def reference_attention(attn, x, cos, sin):
    """Plain multi-head attention with each kv head copied for its group of query heads."""
    b, t, _ = x.shape
    hd, h, kvh = attn.head_dim, attn.n_heads, attn.n_kv_heads
    q = apply_rope(attn.wq(x).view(b, t, h, hd), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(b, t, kvh, hd), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(b, t, kvh, hd).transpose(1, 2)
    k = k.repeat_interleave(h // kvh, dim=1)  # query head i reads kv head i // group
    v = v.repeat_interleave(h // kvh, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    out = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
    return attn.wo(out.transpose(1, 2).reshape(b, t, h * hd))


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_matches_reference(n_kv_heads):
    model = build_model(shape(n_kv_heads=n_kv_heads), SEQ, seed=1)
    attn = model.layers[0].attention
    assert attn.wk.weight.shape[0] == n_kv_heads * model.shape.head_dim
    x = torch.randn(2, SEQ, model.shape.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = attn(x, model.rope_cos, model.rope_sin)
        want = reference_attention(attn, x, model.rope_cos, model.rope_sin)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_rope_preserves_norms_and_position_zero_is_identity(tiny):
    x = torch.randn(1, SEQ, 2, tiny.shape.head_dim)
    y = apply_rope(x, tiny.rope_cos, tiny.rope_sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # a rotation
    torch.testing.assert_close(y[:, 0], x[:, 0])


# --- initialization ---------------------------------------------------------------------


def test_init_is_deterministic_and_seeded():
    s = shape(tie_embeddings=False)
    a, b, c = build_model(s, SEQ, 7), build_model(s, SEQ, 7), build_model(s, SEQ, 8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
        if not k.endswith("norm.weight"):
            assert not torch.equal(sa[k], sc[k]), k
    # Different parameters of one model get different streams.
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sa["layers.1.attention.wq.weight"])


def test_init_independent_of_construction_and_wrapping():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    s = shape()
    built = build_model(s, SEQ, 3)
    direct = Llama(s, SEQ)  # on CPU, not meta
    for i, layer in enumerate(direct.layers):  # engines wrap blocks; names gain a prefix
        direct.layers[i] = checkpoint_wrapper(layer)
    direct.init_weights(3)
    got = dict(zip((n.replace("_checkpoint_wrapped_module.", "") for n, _ in direct.named_parameters()), direct.parameters()))
    for name, p in built.named_parameters():
        assert torch.equal(p, got[name]), name


def test_init_statistics():
    s = shape("small", vocab=4096, tie_embeddings=False)
    m = build_model(s, SEQ, 0)
    out_std = 0.02 / math.sqrt(2 * s.n_layers)
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            want = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            assert abs(p.std().item() / want - 1) < 0.05, name
            assert abs(p.mean().item()) < want / 10, name


def test_tied_and_untied_storage():
    tied = build_model(shape(tie_embeddings=True), SEQ, 0)
    untied = build_model(shape(tie_embeddings=False), SEQ, 0)
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    # One parameter, so an optimizer sees (and updates) it once.
    assert tied.output.weight is tied.tok_embeddings.weight
    assert len(list(tied.parameters())) == len(list(untied.parameters())) - 1


# --- counts and flops -------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("tie", [True, False])
def test_count_params_matches_built_model(preset, tie):
    s = shape(preset, tie_embeddings=tie)
    m = build_model(s, SEQ, 0)
    c = count_params(s)
    assert c["total"] == sum(p.numel() for p in m.parameters())
    assert c["embedding"] == m.tok_embeddings.weight.numel()
    assert c["output"] == (0 if tie else m.output.weight.numel())
    assert c["non_embedding"] == sum(p.numel() for p in m.layers.parameters()) + m.norm.weight.numel()


# Published totals: Llama-3.2-1B, Llama-2-7B, Llama-3-8B, Llama-3-70B, Llama-3.1-405B model cards.
@pytest.mark.parametrize("preset,published", [("1b", 1.24e9), ("7b", 6.74e9), ("8b", 8.03e9), ("70b", 70.6e9), ("405b", 405.9e9)])
def test_count_params_matches_published(preset, published):
    total = count_params(resolve_shape(ModelConfig(preset=preset)))["total"]
    assert abs(total / published - 1) < 0.01


def test_flops_per_token_matches_counted_matmuls():
    s = shape(tie_embeddings=False)
    m = build_model(s, SEQ, 0)
    x = tokens(2)
    counter = FlopCounterMode(display=False)
    with counter:
        loss_fn(m(x), x).backward()
    mm_flops = counter.get_flop_counts()["Global"][torch.ops.aten.mm] / x.numel()
    attention = 12 * s.n_layers * s.dim * SEQ
    # The projections and the head, forward and backward, are exactly the aten.mm calls.
    assert mm_flops == flops_per_token(s, SEQ) - attention
    # The attention term grows linearly with the context.
    assert flops_per_token(s, 2 * SEQ) - flops_per_token(s, SEQ) == attention


# --- shape resolution -------------------------------------------------------------------


def test_resolve_shape_overrides_and_vocab_precedence():
    s = resolve_shape(ModelConfig(preset="small", n_layers=2, rope_theta=5e5), 1000)
    assert (s.n_layers, s.rope_theta, s.vocab_size, s.dim) == (2, 5e5, 1000, 256)
    assert resolve_shape(ModelConfig(preset="tiny", vocab_size=2048), 1000).vocab_size == 2048
    assert resolve_shape(ModelConfig(preset="8b")).vocab_size == 128256  # the published one
    assert resolve_shape(ModelConfig(preset="7b"), 4096).vocab_size == 4096  # the tokenizer's


@pytest.mark.parametrize(
    "overrides,vocab,words",
    [
        (dict(n_heads=6), VOCAB, ["model.n_heads=6", "model.dim=128", "1, 2, 4, 8"]),
        (dict(dim=12, n_heads=4, n_kv_heads=1), VOCAB, ["head_dim=3", "even"]),
        (dict(n_kv_heads=3), VOCAB, ["model.n_kv_heads=3", "model.n_heads=4", "1, 2, 4"]),
        (dict(n_heads=2, n_kv_heads=4), VOCAB, ["model.n_kv_heads=4", "model.n_heads=2"]),
        (dict(), None, ["model.vocab_size", "tokenizer"]),
        (dict(vocab_size=100), VOCAB, ["model.vocab_size=100", str(VOCAB)]),
    ],
)
def test_resolve_shape_errors(overrides, vocab, words):
    with pytest.raises(UserError) as err:
        resolve_shape(ModelConfig(preset="tiny", **overrides), vocab)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


# --- training -----------------------------------------------------------------------------


def test_adamw_learns_a_repeated_batch():
    torch.manual_seed(0)
    m = build_model(shape(), SEQ, 0)
    x = tokens(4, SEQ + 1)
    inputs, targets = x[:, :-1], x[:, 1:]
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = loss_fn(m(inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_bf16_autocast_on_cpu(tiny):
    x = tokens(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = tiny(x)
    assert logits.dtype == torch.bfloat16
    loss = loss_fn(logits, x)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    with torch.no_grad():
        ref = loss_fn(tiny(x), x)
    assert abs(loss.item() - ref.item()) < 0.05


def test_loss_fn_is_fp32_mean_cross_entropy():
    logits = torch.randn(2, 3, 7).bfloat16()
    targets = torch.randint(0, 7, (2, 3))
    want = F.cross_entropy(logits.float().view(6, 7), targets.view(6))
    assert loss_fn(logits, targets).dtype == torch.float32
    torch.testing.assert_close(loss_fn(logits, targets), want)


@pytest.mark.unit
def test_qwen3_attention_heads_wider_than_dim_over_heads_with_query_and_key_norms():
    # The Qwen3 presets' attention: heads of attention_head_dim channels whatever dim / n_heads
    # is, and an RMSNorm over each head's queries and keys (before the rotary embedding).
    from dataclasses import replace

    from scaletrain.models.llama import build_model
    from scaletrain.models.spec import LlamaSpec

    s = replace(shape("tiny"), attention_head_dim=64, qk_norm=True)  # tiny: dim 128, 4 heads of 32 otherwise
    model = build_model(s, SEQ, seed=0)
    attention = model.layers[0].attention
    assert attention.wq.weight.shape == (4 * 64, 128) and attention.wo.weight.shape == (128, 4 * 64)
    assert attention.q_norm.weight.shape == attention.k_norm.weight.shape == (64,)
    loss = F.cross_entropy(model(tokens()).flatten(0, 1), tokens(seed=1).flatten())
    loss.backward()
    assert attention.q_norm.weight.grad.abs().sum() > 0 and attention.k_norm.weight.grad.abs().sum() > 0
    # What the norm changes: scaling a head's queries scales nothing after it.
    q = torch.randn(2, SEQ, 4, 64)
    torch.testing.assert_close(attention.q_norm(3.0 * q), attention.q_norm(q), rtol=1e-5, atol=1e-6)
    # A checkpoint's model entry names these only where they are not Llama's (so that one
    # written before they existed names the same shape); the planner counts the wider heads.
    assert {"attention_head_dim", "qk_norm"} <= LlamaSpec(s).config().keys()
    assert not {"attention_head_dim", "qk_norm"} & LlamaSpec(shape("tiny")).config().keys()
    assert LlamaSpec(s).counts().total == sum(p.numel() for p in model.parameters())
