"""What two runs must agree on, and how closely: the tolerances (derived below) and the
assertions of equivalence, bit-exact resumes and exports that load elsewhere."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from scaletrain.checkpoint import read_model_weights

from helpers.runs import STDLIB, eval_rows, final_weights, metric_rows

# What a correct engine guarantees against one process on the same global batch, in fp32.
# Measured over every equivalence test (world 2 and 3, accumulation, all engines), under
# ATEN_CPU_CAPABILITY=avx2 and =default; a factor in the gradient (a loss divided twice
# by grad_accum, a sum over ranks instead of a mean) moves the grad norm by >= 2x, which
# AdamW and clipping would hide from the losses.
#
# * Step 1 starts from identical weights: loss and grad norm differ only by summation
#   order (per rank, micro-batch, shard; fp32 unit roundoff 6e-8 per addition).
#   Measured <= 2.8e-7; rtol 1e-5.
# * Later steps start from weights that have drifted apart: Adam divides by sqrt(v), so an
#   element whose gradient is within rounding noise of zero takes a step of up to ~lr
#   whatever the noise (m/sqrt(v) is O(1) for any tiny g), and two correct engines may end
#   that element up to lr x steps apart (seen: 1.5e-5 in one element of 49,152 after 10
#   steps, on one CPU and not another). The loss, a mean over 4 x 64 tokens, hardly feels
#   it: measured <= 4.9e-7, rtol 1e-5 at every step. The grad norm does at some steps (the
#   norm of a few dominant entries): measured <= 5.7e-4 (world 3), rtol 5e-3, still 200x
#   below a factor-of-two bug.
# * The eval loss at step N is the same kind of number as the training loss of step N + 1:
#   a mean next-token cross entropy over a fixed set of tokens (2 x 4 x 64 here), computed
#   from the weights after step N, which two correct engines hold up to the drift above.
#   What the evaluation adds is summation order only: each micro-batch's mean back to its
#   sum in fp64, summed over micro-batches and ranks (exact to ~1e-16). So the loss
#   tolerance holds for it too: measured <= 9.6e-8 (zero1-3, fsdp, tp 2, tp 2 x dp 2,
#   pp 2 x dp 2, a teacher on zero3, experts on ep 2). A rank's own mean reported as the
#   whole set's (no reduction over the ranks) was off by 1.3e-3 at world 2, 127x the
#   tolerance; sums reduced without the token counts would be off by a factor of 2.
# * Weights, per tensor, as a relative (Frobenius) difference, not elementwise: the rare
#   amplified elements leave a tensor <= 2.8e-5 apart (measured, world 3); a tensor the
#   optimizer skipped is off by ~0.5, one decayed wrongly by >= 2e-3 (lr 3e-3 x decay 0.1
#   x 10 steps, relative to the weight). Allowed: 2e-4.
# Gradients after one backward are compared elementwise, in tests/test_gradients.py.

RTOL_FIRST_STEP = 1e-5
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 5e-3
WEIGHTS_RTOL = 2e-4


def assert_same_training(
    run: Path,
    ref: Path,
    steps: int = 10,
    evals: bool = True,
    weights_rtol: float | Callable[[str, torch.Tensor], float] = WEIGHTS_RTOL,
    gradient_free: dict[str, slice] | None = None,
    loss_rtol: float = LOSS_RTOL,
) -> None:
    if evals:
        assert_same_evals(run, ref, loss_rtol)
    assert_same_steps(run, ref, steps, loss_rtol)
    assert_weights_close(final_weights(run, steps), final_weights(ref, steps), weights_rtol, gradient_free, steps)


def assert_same_steps(run: Path, ref: Path, steps: int = 10, loss_rtol: float = LOSS_RTOL) -> None:
    """Every step's loss and grad norm within the tolerances above, and the reference trained."""
    a, b = metric_rows(ref), metric_rows(run)
    assert len(a) == len(b) == steps
    losses_a, losses_b = [r["loss"] for r in a], [r["loss"] for r in b]
    norms_a, norms_b = [r["grad_norm"] for r in a], [r["grad_norm"] for r in b]
    np.testing.assert_allclose(norms_b[0], norms_a[0], rtol=RTOL_FIRST_STEP, err_msg="grad norm of step 1")
    np.testing.assert_allclose(losses_b, losses_a, rtol=loss_rtol, err_msg="loss per step")
    np.testing.assert_allclose(norms_b, norms_a, rtol=GRAD_NORM_RTOL, err_msg="grad norm per step")
    assert losses_a[-1] < losses_a[0]  # it trained, not just agreed


def assert_same_evals(run: Path, ref: Path, loss_rtol: float = LOSS_RTOL) -> None:
    want, got = eval_rows(ref), eval_rows(run)
    assert want, f"{ref} has no eval rows to compare with"
    assert [(r["step"], r["tokens"]) for r in got] == [(r["step"], r["tokens"]) for r in want]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=loss_rtol, err_msg="eval loss")


# Elements whose gradient is zero by construction (e.g. an attention key's bias: it adds
# q.b to every score of a query, which the softmax ignores) receive rounding noise only, and
# Adam steps on noise as on anything (the first bullet above): each engine moves them up to
# its per-step bound, lr x max(1, (1 - beta1) / sqrt(1 - beta2)) (Kingma & Ba, section 2.1;
# 1 at the defaults 0.9 / 0.95), from where they started. Seen: an attention key bias 1.3e-5
# in norm, half of it apart between two engines on an avx512 CPU, which no relative
# tolerance of the tensor's other elements survives. No bug can show in them (nothing but
# noise reaches them), so they are held to that bound, the rest of the tensor to rtol.
GRADIENT_FREE_STEP = 3e-3  # base_overrides' peak train.lr, at the default betas


def assert_weights_close(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    rtol: float | Callable[[str, torch.Tensor], float] = WEIGHTS_RTOL,
    gradient_free: dict[str, slice] | None = None,
    steps: int = 0,
) -> None:
    """`rtol`: one tolerance, or each tensor's by its name and value (Muon's matrices, say)."""
    # Key equality: wrappers (activation checkpointing, FSDP, DeepSpeed) leave names plain.
    assert got.keys() == want.keys()
    for k in got:
        tol = rtol(k, want[k]) if callable(rtol) else rtol
        assert got[k].shape == want[k].shape, k
        a, b = got[k].double().flatten(), want[k].double().flatten()
        if gradient_free and k in gradient_free:
            free = torch.zeros(a.numel(), dtype=torch.bool)
            free[gradient_free[k]] = True
            apart = (a[free] - b[free]).abs().max().item()
            assert apart <= 2 * steps * GRADIENT_FREE_STEP, f"{k}: gradient-free elements {apart:.2e} apart"
            a, b = a[~free], b[~free]
        rel = ((a - b).norm() / b.norm()).item()
        assert rel <= tol, f"{k}: relative difference {rel:.2e} (up to {tol:.0e} allowed)"


def assert_bit_exact(run: Path, straight: Path, step: int) -> None:
    """A resumed run equals the uninterrupted one: every metric of every step, every
    evaluation (none lost, none twice), every weight."""
    keys = ("step", "loss", "grad_norm", "lr", "tokens", "loss_scale", "skipped", "perplexity")
    pick = lambda rows: [{k: r[k] for k in keys if k in r} for r in rows]  # noqa: E731
    # As JSON text: a skipped fp16 step's grad norm may be NaN, which equals nothing as a float.
    got, want = (list(map(json.dumps, pick(metric_rows(r) + eval_rows(r)))) for r in (run, straight))
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want):
        assert g == w, f"first difference:\n  resumed  {g}\n  straight {w}"
    a, b = final_weights(run, step), final_weights(straight, step)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_scale_moved(run) -> None:
    rows = metric_rows(run)
    scales = [r["loss_scale"] for r in rows]
    assert any(r["skipped"] for r in rows[:5]), scales  # backed off before the checkpoint at step 5
    assert len(set(scales[4:])) > 1, scales  # and moved again after it
    assert np.mean([r["loss"] for r in rows[-3:]]) < rows[0]["loss"] - 0.3  # and it trained


def assert_hf_export_matches(ckpt: Path, out: Path, tokens: int = 48) -> None:
    """transformers loads the export `out` of checkpoint `ckpt` and gives the logits of the
    built-in model holding the checkpoint's weights. fp32 both sides, same weights: the two
    implementations differ only in summation order (attention through SDPA or not, RMSNorm's
    mean), a few ulps of logits of size ~10 after 4 layers; atol 1e-5 is ~100 ulps."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from scaletrain.models.llama import Llama
    from scaletrain.models.presets import ModelShape

    saved = json.loads((ckpt / "trainer.json").read_text())
    ours = Llama(ModelShape(**saved["model"]), max_seq_len=tokens)
    ours.load_state_dict(read_model_weights(ckpt))
    theirs = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    text = (STDLIB / "json" / "decoder.py").read_text()
    ids = torch.tensor([tokenizer.encode(text)[:tokens]])
    assert ids.shape[1] == tokens
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=0, atol=1e-5)
