"""Mixed precision on every engine family, on 2 ranks: the forward really computes in the
low-precision type, the fp32 masters start from the plain model's initialization (for
DeepSpeed: rounded to the 16-bit type, as DeepSpeed derives them from the cast module), and an
fp16 overflow on ONE rank skips the step on ALL ranks, leaves every weight as it was and
backs the loss scale off; the next clean step updates again."""

from __future__ import annotations

import sys

import pytest

from helpers.launch import PROBES, probe

sys.path.insert(0, str(PROBES))
from precision import ENGINES  # noqa: E402

pytestmark = pytest.mark.dist

INIT = 65536.0  # train.loss_scale_init's default


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every engine in one launch (start-up dominates): one report per rank."""
    return probe("precision", list(ENGINES), tmp_path_factory.mktemp("precision"), nproc=2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", list(ENGINES))
def test_forward_dtype_masters_and_fp16_overflow(reports, strategy):
    ranks = [report[strategy] for report in reports]
    for r in ranks:
        for precision, dtype in (("bf16", "torch.bfloat16"), ("fp16", "torch.float16")):
            forward = r[precision]["forward"]
            assert forward["output"] == dtype, (precision, forward)
            # torch autocast (ddp) casts inside each matmul, the residual stream stays fp32;
            # FSDP's MixedPrecisionPolicy and DeepSpeed run the whole module in 16 bits.
            assert forward["input"] == ("torch.float32" if strategy == "ddp" else dtype), (precision, forward)
            if r is ranks[0]:  # the full weights (rank 0) are the initialization, by plain name
                assert r[precision]["init_keys"] and r[precision]["init_mismatch"] == [], precision
        first, second = r["fp16"]["overflow_on_rank_1"]
        if strategy.startswith("zero"):
            # DeepSpeed's hysteresis 2: the first overflow only spends it, the second halves.
            assert first == {"skipped": True, "scale": INIT, "changed": False}
            assert second == {"skipped": True, "scale": INIT / 2, "changed": False}
        else:
            assert first == {"skipped": True, "scale": INIT / 2, "changed": False}
            assert second == {"skipped": True, "scale": INIT / 4, "changed": False}
        assert r["fp16"]["clean"] == {"skipped": False, "scale": second["scale"], "changed": True}
