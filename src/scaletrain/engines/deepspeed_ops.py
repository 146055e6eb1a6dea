"""`python -m scaletrain.engines.deepspeed_ops`: compile DeepSpeed's CPU ops ahead of time.

DeepSpeed JIT-compiles its C++ ops (the shared-memory comm op, FusedAdam, DeepSpeedCPUAdam)
the first time a run needs them: minutes on a small machine, spent inside the first
training run. `make setup` calls this once so runs start at full speed; the builds are
cached under ~/.cache/torch_extensions. On a CUDA machine there is nothing to do here:
the CUDA ops are built by DeepSpeed for the GPU it finds.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    import torch

    if torch.cuda.is_available():
        print("deepspeed ops: CUDA present, CPU ops not needed")
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder.cpu import (
        CPUAdamBuilder,
        FusedAdamBuilder,
        ShareMemCommBuilder,
    )

    for builder in (ShareMemCommBuilder, FusedAdamBuilder, CPUAdamBuilder):
        t0 = time.perf_counter()
        builder().load(verbose=False)
        print(f"deepspeed ops: {builder.__name__.removesuffix('Builder')} ready ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
