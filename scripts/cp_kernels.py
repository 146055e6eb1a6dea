"""On CUDA: context parallel's rank-local attention (models/context_parallel.py) on the flash
and cuDNN kernels equals full causal attention's rows for the same positions, in bf16.

For cp = 2 and 4 and every rank, each of its two chunks' queries attend to the keys up to
the chunk's end with `causal_lower_right`, the form SplitAttention calls, under each
backend alone; the rows are compared with one full causal attention (the math kernel in
fp32 as the reference). Prints one JSON line per (backend, cp) and exits 1 on a mismatch
or a backend that refuses. No process group: the keys and values a rank would all-gather
are the whole tensors here.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

# bf16 has 8 bits of mantissa: outputs of magnitude ~1 round to 2^-8 = 0.004; a wrong
# offset (a query seeing one future key, or missing one) moves rows by ~1e-1.
ATOL = 2e-2


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA"}))
        return 0
    g = torch.Generator(device="cuda").manual_seed(0)
    b, hq, hkv, t, d = 2, 8, 2, 4096, 64
    q, k, v = (torch.randn(b, h, t, d, device="cuda", generator=g) for h in (hq, hkv, hkv))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    q16, k16, v16 = (x.bfloat16() for x in (q, k, v))
    bad = 0
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        for cp in (2, 4):
            c = t // (2 * cp)
            worst = 0.0
            try:
                with sdpa_kernel([backend]):
                    for rank in range(cp):
                        for chunk in (rank, 2 * cp - 1 - rank):
                            end = (chunk + 1) * c
                            rows = q16[:, :, chunk * c : end]
                            out = F.scaled_dot_product_attention(
                                rows, k16[:, :, :end], v16[:, :, :end], attn_mask=causal_lower_right(c, end), enable_gqa=True
                            )
                            worst = max(worst, (out.float() - ref[:, :, chunk * c : end]).abs().max().item())
                ok = worst <= ATOL
                print(json.dumps({"backend": backend.name, "cp": cp, "max_abs_diff": worst, "atol": ATOL, "ok": ok}))
            except RuntimeError as e:
                ok = False
                print(json.dumps({"backend": backend.name, "cp": cp, "error": str(e).splitlines()[0]}))
            bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
