"""The chunked cross entropy (models/loss.py) equals the plain one, value and gradient, and
the planner counts the memory it saves."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.errors import UserError
from scaletrain.models.loss import cross_entropy
from scaletrain.planning import planning_spec
from scaletrain.planning.memory import Setup, estimate

pytestmark = pytest.mark.unit

# fp32 logits: both compute log-sum-exp over the same row in fp32, summed in another
# order (torch's log_softmax kernel against logsumexp), and the mean over positions in
# another order: differences of a few ulps, 1e-5 relative is the tolerance and
# ~100 ulps of fp32. bf16 logits: both upcast, compute in fp32 and round the gradient to
# bf16 once, so an element differs by at most one bf16 ulp (2^-8 relative) where the
# fp32 values straddle a rounding boundary.


def logits_and_targets(dtype: torch.dtype, n: int = 3, t: int = 8, vocab: int = 97):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(n, t, vocab, generator=gen)).to(dtype).requires_grad_()
    return logits, torch.randint(0, vocab, (n, t), generator=gen)


def value_and_grad(logits: torch.Tensor, targets: torch.Tensor, chunk: int):
    x = logits.detach().clone().requires_grad_()
    loss = cross_entropy(x, targets, chunk)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("chunk", [1, 7, 24, 1000])  # one position, uneven chunks, exact, all in one
def test_chunked_equals_plain_in_fp32(chunk):
    logits, targets = logits_and_targets(torch.float32)
    want_loss, want_grad = value_and_grad(logits, targets, 0)
    got_loss, got_grad = value_and_grad(logits, targets, chunk)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-5 * want_grad.abs().max().item())


def test_chunked_equals_plain_in_bf16_and_keeps_the_dtype():
    logits, targets = logits_and_targets(torch.bfloat16)
    want_loss, want_grad = value_and_grad(logits, targets, 0)
    got_loss, got_grad = value_and_grad(logits, targets, 5)
    assert got_loss.dtype == torch.float32 and got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=2**-8, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunks_equal_the_eager_ones_and_compile_one_shape(dtype):
    """train.compile's loss (models/loss.py): full chunks through inductor, the last, shorter one
    eager. 24 positions in chunks of 10: two compiled, one of 4 eager; a prompt position not
    trained. Tolerances as above: the same fp32 formula, its sums in another order (inductor's
    reduction against aten's logsumexp) and another exp, so a few fp32 ulps, and a bf16
    gradient one bf16 ulp where the two straddle a rounding boundary."""
    from torch._dynamo.utils import counters

    from scaletrain.models import loss as loss_module

    logits, targets = logits_and_targets(dtype)
    targets[0, 0] = -100  # IGNORE_INDEX: a fine-tuning prompt, weighted 0 in either
    want_loss, want_grad = value_and_grad(logits, targets, 10)
    torch._dynamo.reset()
    loss_module._compiled.clear()  # compiled anew in this test, whatever ran before it
    counters.clear()
    x = logits.detach().clone().requires_grad_()
    got = cross_entropy(x, targets, 10, compiled=True)
    got.backward()
    assert counters["stats"]["unique_graphs"] == 2  # the chunk's forward and backward: one shape each, no break
    torch.testing.assert_close(got.detach(), want_loss, rtol=1e-5, atol=0)
    bf16 = dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), want_grad.float(), rtol=2**-8 if bf16 else 1e-5, atol=0 if bf16 else 1e-7)
    assert x.grad[0, 0].abs().max() == 0  # the untrained row: no gradient
    x.grad = None
    cross_entropy(x[:, :7], targets[:, :7], 10, compiled=True).backward()
    assert counters["stats"]["unique_graphs"] == 2  # 21 positions: two full chunks again, a last one of 1 eager: no compile


@pytest.mark.parametrize(("options", "compiled"), [
    (["train.compile=true", "train.loss_chunk_tokens=64"], True),
    (["train.compile=true"], False),  # the whole loss: one aten kernel already
    (["train.loss_chunk_tokens=64"], False),
])  # fmt: skip
def test_train_compile_compiles_the_chunked_loss(options, compiled):
    from scaletrain.models import model_spec

    spec = model_spec(load_config([], ["model.preset=tiny", *options]), 512)
    assert spec.loss_compiled is compiled


def test_gradient_scales_with_the_upstream_gradient():
    # The loss may be scaled (fp16 loss scaling, the 1 / grad_accum of a window).
    logits, targets = logits_and_targets(torch.float32)
    x = logits.detach().clone().requires_grad_()
    (cross_entropy(x, targets, 4) * 8.0).backward()
    _, plain = value_and_grad(logits, targets, 0)
    torch.testing.assert_close(x.grad, 8.0 * plain, rtol=1e-5, atol=1e-6)


def test_planner_counts_a_fraction_of_the_loss_memory():
    # The 7B shape at micro-batch 16 x 4096 (vocabulary 32,000), bf16, fsdp on 8 GPUs: the
    # plain loss holds fp32 log-probabilities and makes an fp32 gradient and temporary,
    # 25.4 GiB; chunked it keeps the bf16 logits and writes a bf16 gradient, 10.8 GiB.
    def loss_gib(chunk: int) -> float:
        spec = planning_spec(load_config([], ["model.preset=7b", f"train.loss_chunk_tokens={chunk}"]))
        return estimate(spec, Setup("fsdp", 8, 16, 4096, "bf16")).loss / 2**30

    plain, chunked = loss_gib(0), loss_gib(4096)
    assert plain == pytest.approx(25.4, abs=0.1)
    assert chunked == pytest.approx(10.8, abs=0.1) and chunked < 0.45 * plain


def test_chunked_loss_is_refused_with_tensor_parallel():
    with pytest.raises(UserError, match="train.loss_chunk_tokens=512 does not combine with parallel.tp=2"):
        load_config([], ["parallel.strategy=fsdp", "parallel.tp=2", "train.loss_chunk_tokens=512"])


def test_the_plan_says_what_chunking_would_save():
    from scaletrain.planning import make_plan
    from scaletrain.planning.hardware import gpu

    overrides = ["model.preset=8b", "data.seq_len=4096", "precision=bf16", "train.micro_batch=4"]
    cfg = load_config([], [*overrides, "parallel.strategy=fsdp", "parallel.activation_checkpointing=true"])
    plan = make_plan(cfg, planning_spec(cfg), 8, 1, gpu("h100", None), all_strategies=False)
    (note,) = [n for n in plan.notes if "train.loss_chunk_tokens=4096" in n]
    assert note.startswith("the loss holds 24.0 GiB of the 42.0 GiB peak") and "would hold 12.2 GiB (peak 30.2 GiB)" in note
    chunked = load_config(
        [], [*overrides, "parallel.strategy=fsdp", "parallel.activation_checkpointing=true", "train.loss_chunk_tokens=4096"]
    )
    assert not make_plan(chunked, planning_spec(chunked), 8, 1, gpu("h100", None), all_strategies=False).notes
