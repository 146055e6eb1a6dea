"""The DeepSpeed JSON, generated from our config so that there is only one place to set anything.

`build_deepspeed_config` is a pure function of (Config, data-parallel size): unit-testable without
processes, and what the engine passes to deepspeed.initialize and saves beside every
checkpoint. `parallel.deepspeed_extra` merges in for DeepSpeed settings we have no key for;
touching a value we set is an error, because two configs that can disagree are the bug this
module exists to prevent.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from scaletrain.config import Config
from scaletrain.config.batch import global_batch
from scaletrain.errors import UserError

ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
# Effectively never: the trainer owns progress output and metrics; DeepSpeed's own periodic
# report would interleave with the progress bar.
STEPS_PER_PRINT = 1_000_000_000

# Where each generated DeepSpeed key comes from, for the conflict message. Keys not listed
# are fixed by scaletrain (no config key) and can only be changed in the source.
_OUR_KEYS = {
    "train_micro_batch_size_per_gpu": "train.micro_batch",
    "gradient_accumulation_steps": "train.grad_accum",
    "train_batch_size": "train.micro_batch x train.grad_accum x the data-parallel size",
    "gradient_clipping": "train.clip_grad",
    "optimizer.params.lr": "train.lr (the schedule sets it every step)",
    "optimizer.params.betas": "train.adam_beta1 / train.adam_beta2",
    "optimizer.params.eps": "train.adam_eps",
    "optimizer.params.weight_decay": "train.weight_decay",
    "fp16.enabled": "precision",
    "fp16.initial_scale_power": "train.loss_scale_init",
    "fp16.loss_scale_window": "train.loss_scale_window",
    "bf16.enabled": "precision",
    "zero_optimization.stage": "parallel.strategy",
    "zero_optimization.offload_optimizer.device": "parallel.offload_optimizer",
    "zero_optimization.offload_optimizer.nvme_path": "parallel.nvme_path",
    "zero_optimization.offload_param.device": "parallel.offload_params",
    "zero_optimization.offload_param.nvme_path": "parallel.nvme_path",
    "zero_optimization.reduce_bucket_size": "parallel.bucket_size",
    "zero_optimization.allgather_bucket_size": "parallel.bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size": "parallel.bucket_size",
}


def build_deepspeed_config(cfg: Config, dp_size: int) -> dict[str, Any]:
    """The complete DeepSpeed config for this run, `parallel.deepspeed_extra` merged in."""
    p, t = cfg.parallel, cfg.train
    if p.strategy not in ZERO_STAGES:
        raise ValueError(f"build_deepspeed_config needs a ZeRO strategy, not {p.strategy}")
    stage = ZERO_STAGES[p.strategy]
    # Page-locked host buffers only help copies to a GPU; DeepSpeed's CPU accelerator ignores them.
    pin = cfg.run.device != "cpu"

    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,  # gradients copied into one buffer as produced: no fragmentation
        # Overlap the gradient reduce with the rest of backward (stage 1 reduces once, after it).
        "overlap_comm": stage >= 2,
        "reduce_bucket_size": p.bucket_size,
    }
    if stage < 3:
        zero["allgather_bucket_size"] = p.bucket_size
    else:
        zero["stage3_prefetch_bucket_size"] = p.bucket_size
    if p.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(p.offload_optimizer, p.nvme_path, pin)
    if p.offload_params != "none":  # the config schema allows it with zero3 only
        zero["offload_param"] = _offload(p.offload_params, p.nvme_path, pin)

    generated: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        # DeepSpeed checks it is micro x accum x its data-parallel ranks: under parallel.cp
        # those are all ranks, the cp ranks of a group reading the same samples (each its
        # part of every sequence), so it counts each sample cp times.
        "train_batch_size": global_batch(t, dp_size) * p.cp,
        # 0.0 is DeepSpeed's "no clipping" too, so the value is always written and comparable.
        "gradient_clipping": float(t.clip_grad),
        # DeepSpeed builds the optimizer itself: FusedAdam, or DeepSpeedCPUAdam when the
        # optimizer is offloaded (its states then live in host memory). AdamW: decoupled
        # decay, as build_adamw. The lr here is only the initial value; the engine sets the
        # scheduled lr on the param groups before every step, so there is no DS scheduler.
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "betas": [t.adam_beta1, t.adam_beta2],
                "eps": t.adam_eps,
                "weight_decay": t.weight_decay,
            },
        },
        "fp16": {"enabled": cfg.precision == "fp16"},
        "bf16": {"enabled": cfg.precision == "bf16"},
        "zero_optimization": zero,
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if cfg.precision == "fp16":
        generated["fp16"].update(
            {
                "loss_scale": 0,  # 0: dynamic loss scaling (DeepSpeed's own scaler)
                "initial_scale_power": int(math.log2(t.loss_scale_init)),  # the schema takes powers of two only
                "loss_scale_window": t.loss_scale_window,  # overflow-free steps before the scale doubles
                "hysteresis": 2,  # overflows tolerated before the scale halves
                "min_loss_scale": 1,
            }
        )
    return merge_extra(generated, p.deepspeed_extra)


def _offload(device: str, nvme_path: str | None, pin: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"device": device, "pin_memory": pin}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


def merge_extra(generated: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `extra` into a copy of `generated`; new keys merge in, a changed value is a UserError."""
    merged = copy.deepcopy(generated)
    _merge_into(merged, extra, prefix="")
    return merged


def _merge_into(into: dict[str, Any], extra: dict[str, Any], prefix: str) -> None:
    for key, value in extra.items():
        dotted = f"{prefix}{key}"
        if key not in into:
            into[key] = copy.deepcopy(value)
        elif isinstance(into[key], dict) and isinstance(value, dict):
            _merge_into(into[key], value, prefix=f"{dotted}.")
        elif not _same(into[key], value):
            raise UserError(_conflict_message(dotted, into[key], value))


def _same(ours: Any, theirs: Any) -> bool:
    # Compare as JSON: a YAML list and our list, or 1 and 1.0, are the same setting.
    if isinstance(ours, dict) != isinstance(theirs, dict):
        return False
    if isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple)):
        return len(ours) == len(theirs) and all(_same(a, b) for a, b in zip(ours, theirs))
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return type(ours) is type(theirs) and ours == theirs
    return ours == theirs


def _conflict_message(dotted: str, ours: Any, theirs: Any) -> str:
    source = _OUR_KEYS.get(dotted)
    fix = (
        f"change {source} instead"
        if source
        else "scaletrain fixes this setting (no config key); remove it from parallel.deepspeed_extra"
    )
    return (
        f"parallel.deepspeed_extra.{dotted} = {json.dumps(theirs)} conflicts with the generated "
        f"DeepSpeed config, which sets {dotted} = {json.dumps(ours)}; {fix}"
    )


def to_json(ds_config: dict[str, Any]) -> str:
    """The exact text saved beside checkpoints; `json.loads` of it equals the dict passed to DeepSpeed."""
    return json.dumps(ds_config, indent=2) + "\n"
