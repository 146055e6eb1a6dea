"""Probe: what mixed precision really does inside each engine, on 2 ranks.

For bf16 and fp16: the dtype the first attention projection computed in (a forward hook
on the module, through every wrapper), and whether the engine's full weights equal the
plain model's initialization under their plain names. For fp16 additionally: two steps
whose loss overflows on rank 1 only, then a clean one, each with the skip flag, the loss
scale after it and whether any weight changed on this rank. Writes OUT/rank<R>.json,
{strategy: {precision: report}}.
"""

from __future__ import annotations

import gc

import torch

from scaletrain.models import build_model, loss_fn
from scaletrain.models.params import canonical_name

from common import SMALL_MODEL, Z3_PARTITION_ALL, build, run_strategies

SEQ = 16  # SMALL_MODEL's data.seq_len
# strategy -> its overrides; FSDP with activation checkpointing (the recompute goes through
# the mixed-precision casts again).
ENGINES = {"ddp": [], "fsdp": ["parallel.activation_checkpointing=true"], "zero2": [], "zero3": [Z3_PARTITION_ALL]}


def forward_dtype(engine) -> dict[str, str]:
    module = getattr(engine, "module", engine.model)
    wq = next(m for n, m in module.named_modules() if canonical_name(n).endswith("layers.0.attention.wq"))
    seen = {}
    handle = wq.register_forward_hook(lambda m, inputs, output: seen.update(input=str(inputs[0].dtype), output=str(output.dtype)))
    try:
        step(engine, poison=False)
    finally:
        handle.remove()
    return seen


def step(engine, poison: bool) -> dict:
    tokens = torch.randint(0, 67, (2, SEQ + 1), generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    loss = (lambda out, y: loss_fn(out, y) * float("inf")) if poison else loss_fn
    engine.forward_backward([(tokens[:, :-1], tokens[:, 1:])], loss)
    before = snapshot(engine)
    stats = engine.step(1e-2)
    after = snapshot(engine)
    changed = any(not torch.equal(b, a) for b, a in zip(before, after))
    # An engine keeps them on the device (no host sync in a step): read here, as telemetry does.
    scale = None if stats.loss_scale is None else float(stats.loss_scale)
    return {"skipped": bool(stats.skipped), "scale": scale, "changed": changed}


def snapshot(engine) -> list[torch.Tensor]:
    """Copies of this rank's own part of every parameter: a DDP replica, an FSDP shard
    (DTensor.to_local), a ZeRO-3 partition (ds_tensor), ZeRO-1/2's low-precision copy."""
    module = getattr(engine, "module", engine.model)
    out = []
    for p in module.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p
        out.append(local.detach().clone())
    return out


def probe_engine(strategy: str, world) -> dict:
    report = {}
    for precision in ("bf16", "fp16"):
        overrides = [*SMALL_MODEL, f"parallel.strategy={strategy}", f"precision={precision}", "train.seed=7", *ENGINES[strategy]]
        engine, spec, _ = build(overrides, world)
        full = engine.full_weights()  # collective; the torch engines fill it on rank 0 only
        r = {}
        if world.rank == 0:  # compared now: unsharded entries may be the live parameters
            plain = build_model(spec.shape, SEQ, seed=7).state_dict()
            # DeepSpeed casts the module to 16 bits before it copies fp32 masters from it, so
            # its masters start at the init rounded to that type; torch engines keep fp32.
            low = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision] if engine.name.startswith("zero") else torch.float32
            r["init_keys"] = sorted(full) == sorted(plain)
            r["init_mismatch"] = [k for k in plain if not torch.equal(full[k].float(), plain[k].to(low).float())]
        r["forward"] = forward_dtype(engine)
        if precision == "fp16":
            r["overflow_on_rank_1"] = [step(engine, poison=world.rank == 1) for _ in range(2)]
            r["clean"] = step(engine, poison=False)
        report[precision] = r
        del engine, full  # no live DDP model at teardown (gloo may abort); DDP holds cycles
        gc.collect()
    return report


if __name__ == "__main__":
    run_strategies(probe_engine)
