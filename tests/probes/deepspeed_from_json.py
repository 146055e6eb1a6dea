"""Probe: DeepSpeed's own engine built from a saved deepspeed_config.json, nothing of ours.

Run under torchrun. For each FILE in turn, `deepspeed.initialize(config=FILE)` on a plain
model, then report the settings DeepSpeed itself runs with (stage, offload devices, the
optimizer class it chose, clipping, batch sizes, precision, loss scaler): OUT/rank<R>.json
holds one entry per FILE. One launch for several files: a launch costs seconds of imports.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402

from scaletrain.config import load_config  # noqa: E402
from scaletrain.engines.deepspeed import _allow_fp16_on_cpu  # noqa: E402  (a CPU-only switch, see there)
from scaletrain.models import build_model, resolve_shape  # noqa: E402


def device_of(offload) -> str | None:
    return None if offload is None else str(getattr(offload.device, "value", offload.device))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("json", nargs="+")
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    runs = [live_settings(path) for path in args.json]
    (Path(args.out) / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(runs))
    torch.distributed.destroy_process_group()


def live_settings(path: str) -> dict:
    saved = json.loads(Path(path).read_text())
    if saved["fp16"]["enabled"]:
        _allow_fp16_on_cpu()
    model = build_model(resolve_shape(load_config([], ["model.vocab_size=512"]).model), 16, seed=0)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=path)
    z = engine._config.zero_config
    live = {
        "stage": int(z.stage),
        "offload_optimizer": device_of(z.offload_optimizer),
        "offload_param": device_of(z.offload_param),
        "optimizer": type(engine.basic_optimizer).__name__,
        "scheduler": scheduler is not None,
        "gradient_clipping": engine.gradient_clipping(),
        "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "train_batch_size": engine.train_batch_size(),
        "world_size": engine.world_size,
        "fp16": engine.fp16_enabled(),
        "bf16": engine.bfloat16_enabled(),
        "param_dtype": str(next(model.parameters()).dtype),
    }
    if engine.fp16_enabled():
        scaler = engine.dynamic_loss_scale_args()
        live |= {
            "loss_scale": engine.optimizer.loss_scale,
            "initial_scale_power": int(math.log2(scaler["init_scale"])),
            "loss_scale_window": scaler["scale_window"],
            "hysteresis": scaler["delayed_shift"],
        }
    # Both ranks drop the engine (ZeRO-3's hooks and partitions) and meet before the next
    # one or before either tears gloo down: once, in CI, rank 1 aborted at exit ("terminate
    # called without an active exception") after rank 0 had destroyed its group first.
    del engine, optimizer, scheduler, model
    gc.collect()
    torch.distributed.barrier()
    return live


if __name__ == "__main__":
    main()
