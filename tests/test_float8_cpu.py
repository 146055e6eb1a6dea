"""train.float8 trained on this CPU: torch 2.13 runs float8 matmuls there (torch._scaled_mm),
rounding as a GPU's float8 tensor cores do, so torchao's Float8Linear trains for real in the
suite: ddp at world 2 equals one process on the same global batch, fsdp at world 2 (its units
gathered in bf16: gloo has no float8 dtypes) and a pipeline of two stages equal fsdp in one
process, and a float8 run is
not the bf16 run (its products rounded to float8) but stays close to it.

Tolerances (all runs bf16, float8 training's precision, the tiny preset at seq 64, 6 steps;
measured 2026-12-01 on this project's 2-core Xeon under ATEN_CPU_CAPABILITY default and avx2):
- One process against world 2, same engine, same global batch: each micro-batch's forward is
  the same computation on the same weights (torchao's tensorwise scales are each tensor's own
  amax, so a micro-batch's scales do not depend on the others'), so step 1 differs only in how
  the fp32 gradients are summed (ranks against micro-batches). Measured: equal to 6 digits
  (ddp and fsdp); FIRST_RTOL 1e-5, as for fp32 (tests/helpers/numerics.py). A skipped
  all-reduce or a gradient divided twice moves step 1's grad norm by 10% to 2x.
- Later steps start from weights that drifted by that rounding through Adam, and float8
  amplifies it: a scale is 448 / amax, so a weight one ulp off moves its tensor's scale and can
  move an element across a float8 rounding step (e4m3 keeps 3 mantissa bits: 6-12% of the
  element). Measured: ddp equal to 6 digits at every step; fsdp, whose ranks each reduce a
  shard, loss up to 6.9e-5 apart and grad norm up to 1.0% (step 6, default kernels; 0.3% under
  avx2). LATER_LOSS_RTOL 1e-3 (14x), LATER_NORM_RTOL 5e-2 (5x: a grad norm is the norm of a
  few dominant entries, the number float8's flips move most).
- float8 against bf16, same engine: e4m3 rounds each operand by up to 2^-4 relative, but a
  product's output averages that over its K terms, and the loss, a mean over 256 tokens of a
  log-softmax, averages again: measured 8.6e-5 apart at step 1 and at most 2.4e-4 over the six
  steps. So: more than 1e-5 apart at step 1 (a conversion that did not happen leaves them
  equal, as two bf16 runs are) and within F8_VS_BF16_RTOL = 2e-3 (8x) at every step.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.launch import check, train
from helpers.runs import base_overrides, metric_rows, run_info

STEPS = 6
FLOAT8 = ["precision=bf16", "train.float8=true", "train.log_every=1"]

FIRST_RTOL = 1e-5  # the module docstring derives each
LATER_LOSS_RTOL = 1e-3
LATER_NORM_RTOL = 5e-2
F8_VS_BF16_RTOL = 2e-3


def _run(small_dataset, run, strategy: str, nproc: int, *extra: str, accum: int | None = None):
    """`STEPS` steps of 2 x 2 sequences: micro-batches of 2, accumulated over what the ranks do not hold."""
    accum = accum or 2 // nproc
    args = [*base_overrides(small_dataset, run, steps=STEPS), f"parallel.strategy={strategy}", "train.micro_batch=2"]
    check(train([*args, f"train.grad_accum={accum}", *FLOAT8, *extra], nproc=nproc))
    return metric_rows(run)


def _assert_same_training(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want) == STEPS
    loss = lambda rows: np.array([r["loss"] for r in rows])  # noqa: E731
    norm = lambda rows: np.array([r["grad_norm"] for r in rows])  # noqa: E731
    np.testing.assert_allclose(loss(got)[0], loss(want)[0], rtol=FIRST_RTOL, err_msg="step 1's loss")
    np.testing.assert_allclose(norm(got)[0], norm(want)[0], rtol=FIRST_RTOL, err_msg="step 1's grad norm")
    np.testing.assert_allclose(loss(got), loss(want), rtol=LATER_LOSS_RTOL, err_msg="loss per step")
    np.testing.assert_allclose(norm(got), norm(want), rtol=LATER_NORM_RTOL, err_msg="grad norm per step")
    assert loss(want)[-1] < loss(want)[0]  # it trained


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_float8_at_world_2_equals_one_process(small_dataset, tmp_path, strategy):
    one = _run(small_dataset, tmp_path / "one", strategy, 1)
    two = _run(small_dataset, tmp_path / "two", strategy, 2)
    info = run_info(tmp_path / "two")
    assert (info["engine"], info["world_size"], info["device"]) == (strategy, 2, "cpu")
    print(
        f"{strategy}: "
        + ", ".join(f"{a['loss']:.6f}/{b['loss']:.6f} {a['grad_norm']:.5f}/{b['grad_norm']:.5f}" for a, b in zip(one, two))
    )
    _assert_same_training(two, one)


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(600)
def test_float8_with_a_pipeline_equals_one_process(small_dataset, tmp_path):
    # Two stages of two blocks each, each stage's Linear layers converted (engines/fsdp.py): the
    # same 2 micro-batches a step as one process accumulating them.
    untied = "model.tie_embeddings=false"  # a pipeline's first and last stages hold their own
    one = _run(small_dataset, tmp_path / "one", "fsdp", 1, untied, accum=2)
    two = _run(small_dataset, tmp_path / "pp", "fsdp", 2, untied, "parallel.pp=2", accum=2)
    assert run_info(tmp_path / "pp")["world_size"] == 2
    _assert_same_training(two, one)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_float8_rounds_its_products_but_trains_as_bf16_does(small_dataset, tmp_path):
    f8 = _run(small_dataset, tmp_path / "f8", "ddp", 1)
    bf = _run(small_dataset, tmp_path / "bf16", "ddp", 1, "train.float8=false")
    got, want = np.array([r["loss"] for r in f8]), np.array([r["loss"] for r in bf])
    print("float8 / bf16 loss: " + ", ".join(f"{a:.6f}/{b:.6f}" for a, b in zip(got, want)))
    # Not the bf16 run: the float8 products ran (a conversion skipped would leave them equal).
    assert abs(got[0] - want[0]) > 1e-5 * want[0], (got[0], want[0])
    np.testing.assert_allclose(got, want, rtol=F8_VS_BF16_RTOL, err_msg="float8 against bf16, per step")
    assert got[-1] < got[0]
