"""What every torch.compile of scaletrain's sets first: the blocks' (engines/block_wrappers.py)
and the chunked loss's (models/loss.py)."""

from __future__ import annotations

import os


def portable_cpu_code() -> None:
    """Inductor picks its CPU vector width from the CPU, not from ATen's capability: with
    ATen's portable kernels forced (ATEN_CPU_CAPABILITY=default), its vectorized C++ does not
    compile ("'at::vec' has not been declared", torch 2.13). Scalar code compiles and
    computes the same. A no-op otherwise."""
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        import torch._inductor.config as inductor

        inductor.cpp.simdlen = 1
