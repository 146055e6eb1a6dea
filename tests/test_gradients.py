"""Acceptance: after one accumulation window every engine holds the gradients of one plain
backward over the whole global batch, elementwise, under two CPU kernel families.

This is what a correct engine guarantees exactly up to rounding, before any optimizer
can hide a wrong factor (AdamW ignores a constant scale, clipping normalises it) or
amplify rounding noise (Adam's division by sqrt(v)). A loss divided twice by grad_accum,
a sum over ranks instead of a mean, a skipped all-reduce or a missing shard all fail here.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.models import build_model, loss_fn, resolve_shape

from helpers.launch import PROBES, probe

sys.path.insert(0, str(PROBES))
from one_backward import (  # noqa: E402
    COMPILED_TP_VARIANTS,
    CP_VARIANTS,
    DOCUMENTS,
    MODEL,
    MOE,
    MOE_CP_VARIANTS,
    MOE_VARIANTS,
    PIPELINE_VARIANTS,
    SEQ,
    UNTIED,
    VARIANTS,
    FixedBatch,
)

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

# Tolerance. Each gradient element is a sum over 4 x 32 token positions (and, inside, over
# the model's reductions), formed in another order by every layout (per rank, per
# micro-batch, then averaged) and by every CPU kernel family. fp32 rounding of a sum of n
# terms is up to ~n x 6e-8 of the sum of their absolute values, and that sum is set by the
# tensor's large terms, not by the element: an element whose terms cancel (a gradient near
# zero) keeps the absolute error of the big ones. So the bound is absolute, per tensor:
# 1e-5 of the tensor's largest gradient (n = 128 gives ~8e-6), plus rtol 1e-5. Measured
# worst: 1.3e-6 of the largest (ATEN_CPU_CAPABILITY=default against avx2), a tenth of what
# is allowed; a factor-of-two bug is 10^4-10^5 times larger.
RTOL, ATOL_OF_MAX = 1e-5, 1e-5
# The machine's own kernels (avx2 or avx512 on x86) and torch's portable ones.
CAPABILITIES = ["native", "default"]


@functools.cache  # each reference once per module: the cp variants of a mixture of experts share theirs
def one_process(*extra: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, no engine, the whole global batch in one forward and backward (read, never
    changed, by the tests that compare with it)."""
    cfg = load_config([], [*MODEL, *extra])
    documents = cfg.data.document_mask
    model = build_model(resolve_shape(cfg.model), SEQ, seed=cfg.train.seed, document_eos=0 if documents else None)
    tokens = torch.from_numpy(FixedBatch(documents).tokens)
    out = model(tokens[:, :-1])
    # A mixture of experts returns (logits, auxiliary loss): the gradient is of their sum,
    # the value the cross entropy alone, as the engines' (models/spec.py loss).
    ce = loss_fn(out[0] if isinstance(out, tuple) else out, tokens[:, 1:])
    (ce + out[1] if isinstance(out, tuple) else ce).backward()
    return ce.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


ALL = [*VARIANTS, *COMPILED_TP_VARIANTS, *PIPELINE_VARIANTS, *MOE_VARIANTS, *CP_VARIANTS, *MOE_CP_VARIANTS]


@pytest.fixture(scope="module")
def reference():
    return one_process()


@pytest.fixture(scope="module")
def untied_reference():
    return one_process(UNTIED)


@pytest.fixture(scope="module")
def moe_reference():
    return one_process(*MOE)


@pytest.fixture(scope="module")
def documents_reference():
    return one_process(DOCUMENTS)


@pytest.fixture(scope="module", params=CAPABILITIES)
def engine_grads(request, tmp_path_factory):
    """All variants on 2 ranks under one ATEN_CPU_CAPABILITY (one launch: start-up dominates)."""
    out = tmp_path_factory.mktemp(f"grads-{request.param}")
    env = {} if request.param == "native" else {"ATEN_CPU_CAPABILITY": request.param}
    probe("one_backward", ALL, out, nproc=2, env=env)
    return torch.load(out / "grads.pt", weights_only=True)


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        atol = ATOL_OF_MAX * want[name].abs().max().item()
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", ALL)
def test_gradients_after_one_backward_equal_one_process(
    engine_grads, reference, untied_reference, moe_reference, documents_reference, variant
):
    # Pipeline variants (every schedule) build the model untied; the same tolerance holds:
    # a schedule changes only the order in which micro-batches' gradients are summed (and
    # scales the sum by 1/4, exact in binary). Mixture-of-experts variants likewise: each
    # token's experts are the same in any split, and under expert parallel its slots are
    # computed on another rank, in the same order among that expert's slots.
    # Compiled pipelines likewise: each stage's blocks compiled, the schedule's order unchanged.
    # Tensor parallel compiled: inductor fuses and reorders the blocks' fp32 arithmetic, a few
    # ulps an operation (tests/test_compile.py), far inside the bound; a lost gradient is not.
    untied = UNTIED in (PIPELINE_VARIANTS | COMPILED_TP_VARIANTS).get(variant, [])
    ref_loss, ref_grads = untied_reference if untied else reference
    if variant in MOE_VARIANTS:
        ref_loss, ref_grads = moe_reference
    # Context parallel: each rank's loss is the mean of its half of every sequence, the
    # gradient reduced over the cp ranks; a key's gradient is summed over the ranks whose
    # queries read it (the all-gather's backward): sums of the same terms regrouped.
    if variant in CP_VARIANTS and DOCUMENTS in CP_VARIANTS[variant]:
        ref_loss, ref_grads = documents_reference
    # A mixture of experts under cp with its balance term: the routing counts of the
    # whole sequences (summed over the cp group), each rank's mean scores of its part.
    if variant in MOE_CP_VARIANTS:
        ref_loss, ref_grads = one_process(*MOE_CP_VARIANTS[variant][0])
    got = engine_grads[variant]
    assert got["compiled_blocks"] > 0 if "_compiled" in variant else got["compiled_blocks"] == 0
    assert got["loss"] == pytest.approx(ref_loss, rel=RTOL)
    assert_grads_close(got["grads"], ref_grads)
