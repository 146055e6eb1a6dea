"""Document masking (data.document_mask, models/documents.py): a packed sample of two
documents computes what each document computes alone (logits, loss, gradients), on the
masked-SDPA path and against FlexAttention's block mask; the FLOPs count the documents'
attention. The runs with it are in test_finetune.py (with fine-tuning records) and below."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from scaletrain.config import ModelConfig
from scaletrain.models import documents
from scaletrain.models.documents import document_layout, document_mask, mean_context
from scaletrain.models.llama import build_model
from scaletrain.models.loss import cross_entropy
from scaletrain.models.presets import resolve_shape
from scaletrain.models.spec import LlamaSpec

pytestmark = pytest.mark.unit

VOCAB, EOS, SEQ = 256, 0, 32
# fp32 on both sides, the same weights and the same per-position arithmetic; only the
# reductions' lengths differ (a softmax and a weighted sum over 32 keys of which the other
# document's are exact zeros, against over the document's own keys). Vectorized sums
# regroup with the length: a few ulps (1e-7 relative) per reduction, through 2 blocks and
# the head's 64-wide dot products; measured 4.8e-7 on logits up to 2.2 (avx512). A mask
# that lets one key of the other document through moves them by ~1e-2.
ATOL = 2e-5


def _model(document_eos: int | None = EOS) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(resolve_shape(ModelConfig(preset="tiny"), VOCAB), SEQ, seed=3, document_eos=document_eos)


def _documents() -> tuple[torch.Tensor, torch.Tensor]:
    """Two documents of 12 and 20 tokens, each ending in eos, and their packed sample."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(1, VOCAB, (12,), generator=g)
    b = torch.randint(1, VOCAB, (20,), generator=g)
    a[-1] = b[-1] = EOS
    return a, b


def test_layout_restarts_positions_after_each_eos():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9], [EOS, 1, 2, 3, 4, 5, 6, 7]])
    doc, pos = document_layout(tokens, EOS)
    assert doc.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_a_packed_sample_computes_each_document_alone():
    model = _model()
    a, b = _documents()
    packed = torch.cat([a, b])[None]
    logits = model(packed)
    alone_a, alone_b = model(a[None]), model(b[None])
    torch.testing.assert_close(logits[0, :12], alone_a[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[0, 12:], alone_b[0], atol=ATOL, rtol=0)
    # The loss: the packed sample's summed per-token loss is the documents' sums added
    # (next-token targets inside each document; the packed one also predicts b's first
    # token from a's eos, left out on both sides by giving it no target).
    targets = torch.cat([a[1:], torch.tensor([-100]), b[1:], torch.tensor([-100])])[None]
    packed_sum = cross_entropy(logits, targets) * 30
    alone_sum = cross_entropy(alone_a[:, :-1], a[None, 1:]) * 11 + cross_entropy(alone_b[:, :-1], b[None, 1:]) * 19
    torch.testing.assert_close(packed_sum, alone_sum, atol=ATOL * 30, rtol=0)


def test_gradients_of_a_packed_sample_are_the_documents_gradients_added():
    a, b = _documents()
    packed_model, alone_model = _model(), _model()
    targets = torch.cat([a[1:], torch.tensor([-100]), b[1:], torch.tensor([-100])])[None]
    (cross_entropy(packed_model(torch.cat([a, b])[None]), targets) * 30).backward()
    for doc in (a, b):
        (cross_entropy(alone_model(doc[None])[:, :-1], doc[None, 1:]) * (len(doc) - 1)).backward()
    for (name, p), q in zip(packed_model.named_parameters(), alone_model.parameters()):
        # Sums of 30 per-token gradients each ~1e-3, regrouped: 1e-6 of the largest entry.
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6 * float(q.grad.abs().max()) + 1e-9, rtol=0, msg=name)


def test_without_the_mask_the_documents_see_each_other():
    # The control: the same comparison fails for the model without masking, so the
    # equality above is the mask's doing, not the data's.
    model = _model(document_eos=None)
    a, b = _documents()
    assert not torch.allclose(model(torch.cat([a, b])[None])[0, 12:], model(b[None])[0], atol=1e-2)


def test_flex_block_mask_equals_the_boolean_mask(monkeypatch):
    # The CUDA path's FlexAttention, run eagerly here (compiled on the GPU): the same
    # attention as the boolean mask for any documents, grouped-query heads included.
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(documents, "_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (2, 256), generator=g)  # eos (0) about every 6th token: many documents
    doc, _ = document_layout(tokens, EOS)
    q, k, v = (torch.randn(2, h, 256, 16, generator=g) for h in (4, 2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex says it is slow
        flex = documents.attend(q, k, v, document_mask(doc, flex=True), gqa=True)
    sdpa = documents.attend(q, k, v, document_mask(doc, flex=False), gqa=True)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=0)  # measured 4e-7: fp32 softmaxes regrouped


def test_a_sliding_window_s_block_mask_equals_the_boolean_mask_and_transformers_mask(monkeypatch):
    # Ulysses' sliding window for Hugging Face models (models/ulysses.py): the CUDA path's
    # block mask run eagerly against the boolean one, with a scale of the model's own; the
    # boolean one is transformers' own sliding-window mask (masking_utils).
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.masking_utils import sliding_window_causal_mask_function

    monkeypatch.setattr(documents, "_flex", lambda: flex_attention)
    allowed = documents.window_mask(256, 40, torch.device("cpu"), flex=False)[0, 0]
    theirs = sliding_window_causal_mask_function(40)
    idx = torch.arange(256)
    assert torch.equal(allowed, theirs(0, 0, idx[:, None], idx[None, :]))
    assert allowed.sum() == sum(min(q + 1, 40) for q in range(256))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 256, 16, generator=g) for h in (4, 2, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex says it is slow
        flex = documents.attend(q, k, v, documents.window_mask(256, 40, torch.device("cpu"), flex=True), gqa=True, scale=0.1)
    sdpa = documents.attend(q, k, v, documents.window_mask(256, 40, torch.device("cpu"), flex=False), gqa=True, scale=0.1)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=0)  # fp32 softmaxes regrouped, as for documents


def test_mean_context_and_the_flops_it_saves():
    windows = np.array([[4, 4, EOS, 5, 5, 5, EOS, 6]])
    assert mean_context(windows, EOS) == (3 * 3 + 4 * 4 + 1 * 1) / 8
    shape = resolve_shape(ModelConfig(preset="tiny"), VOCAB)
    full, masked = LlamaSpec(shape), LlamaSpec(shape, document_eos=EOS, mean_context=16.0)
    attention = 12 * shape.n_layers * shape.n_heads * shape.head_dim
    assert full.flops_per_token(64) - masked.flops_per_token(64) == attention * (64 - 16)
    assert masked.flops_per_token(8) == full.flops_per_token(8)  # a span past the sequence: the sequence


def test_the_planner_counts_the_documents_attention_from_prepared_data(small_dataset):
    from scaletrain.config import load_config
    from scaletrain.planning import planning_spec

    base = [f"data.paths={small_dataset}", "model.preset=tiny", "data.seq_len=512"]
    full = planning_spec(load_config([], base))
    masked = planning_spec(load_config([], [*base, "data.document_mask=true"]))
    # The small corpus: 27 source files of 7,500 tokens on average, so a 512-token window
    # mostly lies inside one; its first 64 windows give a span of 491 tokens.
    assert full.mean_context == 0 and 256 < masked.mean_context < 512
    assert masked.flops_per_token(512) < full.flops_per_token(512)
