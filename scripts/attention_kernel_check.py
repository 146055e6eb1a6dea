"""Which attention kernel a step really runs under train.attention_kernel, eager and compiled, on a
GPU (a lent one's device call: scripts/device_call.sh). On 2026-11-30 `auto` took cuDNN's attention
at 1.38x FlashAttention's measured speed and the compiled 1b step ran exactly as fast as with
FlashAttention pinned; this names the kernels the profiler saw for the 1b preset's attention call
(as the model makes it: 32 query heads, 8 key and value heads, a transposed view) with each kernel
first in SDPA's priority, with their time, and the same call's time per kernel as `auto` measures it.

    python3 scripts/attention_kernel_check.py OUT_DIR      # writes OUT_DIR/attention-kernels.json
    python3 scripts/attention_kernel_check.py OUT_DIR --cpu   # the script itself, on a small call here
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from scaletrain.training.attention_kernel import AttentionCall, order, time_kernel

# The 1b preset at micro-batch 8 x 2048 tokens: what scripts/gpu_peers.py's compiled rows run.
CALL = AttentionCall.contiguous((8, 32, 2048, 64), kv_heads=8)
WORDS = ("attn", "attention", "fmha", "flash", "cudnn", "sdpa")


def kernels_ran(fn, q, k, v, device: torch.device) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The attention kernels the profiler saw in a forward and backward of `fn`: name -> ms."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(2):  # compile and warm up outside the profile
        fn(q, k, v).sum().backward()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn(q, k, v).sum().backward()
        sync()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        spent = e.device_time_total if cuda else e.self_cpu_time_total
        if any(w in e.key.lower() for w in WORDS) and spent > 0:
            out[e.key[:120]] = round(spent / 1e3, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--cpu", action="store_true", help="a small call on this CPU (the script's own check)")
    a = ap.parse_args()
    device = torch.device("cpu" if a.cpu else "cuda")
    call = AttentionCall.contiguous((1, 4, 64, 16), kv_heads=2) if a.cpu else CALL
    a.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"call": {"q": call.q, "k": call.k, "gqa": call.gqa}, "torch": torch.__version__}
    result["measured_s"] = {k: time_kernel(k, call, torch.bfloat16, device) for k in ("flash", "cudnn")}
    for first in ("flash", "cudnn"):
        for compiled in (False, True):
            q, k, v = (t.requires_grad_(True) for t in call.tensors(torch.bfloat16, device))
            torch._dynamo.reset()
            fn = torch.compile(call.sdpa) if compiled else call.sdpa
            with sdpa_kernel(order(first), set_priority=True):
                try:
                    ran = kernels_ran(fn, q, k, v, device)
                except Exception as e:  # noqa: BLE001 - a finding, not a crash
                    ran = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}  # type: ignore[dict-item]
            result[f"{first}-first-{'compiled' if compiled else 'eager'}"] = ran
            (a.out / "attention-kernels.json").write_text(json.dumps(result, indent=1) + "\n")
            print(first, "compiled" if compiled else "eager", ran, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
