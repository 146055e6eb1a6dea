"""torch's AdamW step, foreach against fused, on a preset's parameters (docs/gpu.md).

    .venv/bin/python scripts/adamw_kernels.py [--preset small] [--device cpu] [--rounds 5]

Times optimizer.step() alone (gradients filled once, random) for both implementations,
interleaved round by round (A B A B ...: this machine's speed drifts), and prints the median
milliseconds per step of each and their ratio. Run with OMP_NUM_THREADS set as training runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scaletrain.config import load_config
from scaletrain.models import model_spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device(args.device)
    spec = model_spec(load_config([], [f"model.preset={args.preset}", "model.vocab_size=4096"]), None)
    model = spec.build_meta(128)
    spec.materialize(model, device, 0)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizers = {
        "foreach": torch.optim.AdamW(params, lr=1e-4, foreach=True),
        "fused": torch.optim.AdamW(params, lr=1e-4, fused=True),
    }
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for opt in optimizers.values():
        opt.step()  # state allocated outside the timing
    for _ in range(args.rounds):
        for name, opt in optimizers.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    n = sum(p.numel() for p in params)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.preset} ({n / 1e6:.1f}M parameters), {device}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    for name, ms in med.items():
        print(f"  {name:8s} {ms:8.2f} ms per step (median of {args.rounds} rounds of {args.steps})")
    print(f"  foreach / fused: {med['foreach'] / med['fused']:.1f}x")


if __name__ == "__main__":
    main()
