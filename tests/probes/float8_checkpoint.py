"""Probe: a float8 model's state through the real ddp and fsdp engines, on a CPU.

The state FSDP holds with its float8 all-gather, which runs over NCCL only (gloo has no float8
dtypes: on a CPU the engine gathers in bf16), so this probe swaps the engines' `apply_float8`
for the conversion alone (engines/float8.py's `convert`, FSDP's with the float8 all-gather, as
on a GPU) and never runs a forward, which would gather. It builds
each engine with and without float8 from the same seed and checks what a checkpoint
depends on: the same state-dict keys, plain tensors (no torchao subclass) with the same
values, one optimizer step on the converted model, a DCP save of each loaded by the other,
and torchao's FSDP scale precompute. Writes OUT/rank0.json; the float8 fsdp checkpoint
stays in OUT/f8 for the test to read in a process without torchao.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import scaletrain.engines.ddp as ddp_engine
import scaletrain.engines.fsdp as fsdp_engine
from scaletrain.config import load_config
from scaletrain.config.parallel import dims_for
from scaletrain.engines import build_engine
from scaletrain.engines.float8 import convert
from scaletrain.launch.distributed import init_distributed
from scaletrain.models import model_spec
from scaletrain.optim.optimizers import decay_groups

from common import SMALL_MODEL


def as_on_a_gpu(model, spec, device, fsdp):
    """The conversion as on a GPU: FSDP with its float8 all-gather (the engine turns that off
    over gloo, which has no float8 dtypes; this probe runs no forward, so nothing is gathered:
    it checks the state the NCCL path holds)."""
    return convert(model, spec, fsdp)


def engine(world, strategy: str, float8: bool, seed: int):
    cfg = load_config([], [*SMALL_MODEL, f"parallel.strategy={strategy}", "precision=bf16", f"train.seed={seed}"])
    # The flag set past the config's checks (this probe builds engines without running them).
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"float8": float8})})
    spec = model_spec(cfg, None)
    return build_engine(spec, world, dims_for(cfg.parallel, world.world_size), cfg, decay_groups(cfg.train))


def full(e) -> dict[str, torch.Tensor]:
    return e.state_dict()["model"]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = Path(ap.parse_args().out)
    fsdp_engine.apply_float8 = lambda model, spec, device, fsdp: as_on_a_gpu(model, spec, device, True)  # type: ignore[assignment]
    ddp_engine.apply_float8 = as_on_a_gpu  # type: ignore[assignment]
    world = init_distributed("cpu", "gloo")
    report: dict = {}
    for strategy in ("ddp", "fsdp"):
        f8, plain = engine(world, strategy, True, 7), engine(world, strategy, False, 7)
        wq = f8.model.module if hasattr(f8.model, "module") else f8.model
        linear = wq.layers[0].attention.wq
        weight = linear.weight.to_local() if isinstance(linear.weight, DTensor) else linear.weight
        a, b = full(f8), full(plain)
        report[strategy] = {
            "converted": sorted(n for n, m in wq.named_modules() if type(m).__name__ == "Float8Linear"),
            "weight_type": type(weight).__name__,
            "same_keys": a.keys() == b.keys(),
            "plain_tensors": all(type(v) is torch.Tensor for v in a.values()),
            "same_init": same(a, b),
        }
    f8, plain = engine(world, "fsdp", True, 7), engine(world, "fsdp", False, 8)
    # One optimizer step on the converted model (gradients set by hand: no float8 forward
    # on a CPU): AdamW's moments must come out as plain tensors too.
    for p in f8.model.parameters():
        p.grad = torch.ones_like(p) * 1e-3
    f8.step(1e-3)
    f8.float8.after_step()
    scales = [m.weight._local_tensor._precomputed_scale for m in f8.model.modules() if type(m).__name__ == "Float8Linear"]
    state = f8.state_dict()
    report["step"] = {
        "optimizer_plain": all(type(v) is torch.Tensor for v in state["optim"].values() if isinstance(v, torch.Tensor)),
        "moments": sum(".exp_avg" in k for k in state["optim"]),
        "scales": len(scales) if all(s is not None for s in scales) else 0,
    }
    f8.save(out / "f8")
    plain.load(out / "f8")
    report["f8_into_plain"] = same(full(plain), state["model"])
    other = engine(world, "fsdp", False, 9)
    other.save(out / "plain")
    f8b = engine(world, "fsdp", True, 10)
    f8b.load(out / "plain")
    report["plain_into_f8"] = same(full(f8b), full(other))
    (out / "rank0.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
