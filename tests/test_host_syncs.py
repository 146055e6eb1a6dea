"""No host synchronisation inside a training step (docs/gpu.md, "Host reads").

Each layout trains 4 steps with telemetry.host_syncs on (telemetry/syncs.py counts every
host read of a device tensor, with where it was made) and log_every 2. The second interval
(steps 3-4, steady state) must read nothing inside its steps but what is named below as
inherent, exactly that many per step, and read the interval's figures once at its flush.
On a CPU every tensor is on the run's device, so the count sees the very calls a GPU run
makes (and on the GPU the same count runs for real: scripts/gpu_checklist.py).
"""

from __future__ import annotations

import re

import pytest

from scaletrain.telemetry import read_metrics

from helpers.launch import check, train
from helpers.runs import base_overrides

pytestmark = pytest.mark.dist

# The flush's one read: the losses, gradient norms, the engines' device flags (loss scale,
# skipped) and a mixture of experts' routing, concatenated into one tensor.
FLUSH = {"scaletrain/telemetry/metrics.py StepRecorder._read: tolist": 1}
# DeepSpeed 0.19.8's own step reads its gradient norm's validity on the host (engine.step ->
# the ZeRO optimizer -> runtime/utils.py is_invalid_grad_norm): 3 per step under ZeRO-2 (its
# overflow check, the norm for clipping, the step's record), 1 under ZeRO-3. Inside the
# engine, which scaletrain does not replace; counted exactly so that a new one shows.
DEEPSPEED = "deepspeed/runtime/utils.py is_invalid_grad_norm: __bool__"
# Tensor parallel's vocabulary-split embedding (torch's DTensor _MaskPartial) zeroes the
# ids outside this rank's rows with a boolean-mask assignment, once per forward: inside
# torch, whose CUDA kernel may or may not read the mask's size back (the GPU count says).
TP_EMBEDDING = "scaletrain/models/llama.py Llama.forward: __setitem__"
# A mixture of experts (tiny-moe: 4 MoE layers, one forward per step here). The grouped
# matrix multiply reads nothing; the loop over experts reads each layer's token counts to
# split the slots (models/moe.py), and expert parallel each layer's all-to-all split sizes,
# both in one .tolist() per layer per forward (docs/moe.md, "Host synchronisations that stay").
MOE = ["model.preset=tiny-moe", "parallel.strategy=fsdp"]
MOE_LOOP = "scaletrain/models/moe.py GroupedExperts.forward: tolist"
MOE_EP = "scaletrain/models/moe.py exchange_slots: tolist"

# name: (ranks, overrides, the reads per step that stay)
LAYOUTS = {
    "ddp-accum": (2, ["parallel.strategy=ddp", "train.micro_batch=1", "train.grad_accum=2"], {}),
    "ddp-fp16": (1, ["parallel.strategy=ddp", "precision=fp16"], {}),  # the loss scaler's path
    "fsdp": (2, ["parallel.strategy=fsdp"], {}),
    "zero2": (2, ["parallel.strategy=zero2", "parallel.bucket_size=2000000"], {DEEPSPEED: 3}),
    "zero3": (2, ["parallel.strategy=zero3", "parallel.bucket_size=2000000"], {DEEPSPEED: 1}),
    "tp2": (2, ["parallel.strategy=fsdp", "parallel.tp=2"], {TP_EMBEDDING: 1}),
    "pp2": (2, ["parallel.strategy=fsdp", "parallel.pp=2", "train.micro_batch=1", "train.grad_accum=2", "model.tie_embeddings=false"], {}),
    "cp2": (2, ["parallel.strategy=fsdp", "parallel.cp=2"], {}),
    "moe-grouped": (1, [*MOE, "model.moe.experts_impl=grouped"], {}),
    "moe-loop": (1, [*MOE, "model.moe.experts_impl=loop"], {MOE_LOOP: 4}),
    "moe-ep2": (2, [*MOE, "parallel.ep=2"], {MOE_EP: 4}),  # experts_impl auto: grouped on this CPU
}  # fmt: skip


def sites(counted: dict[str, int], steps: int) -> dict[str, float]:
    """Per step, by file, function and call: the line numbers and our frame that called into
    another package dropped (a read moved within its function is the same read)."""
    out: dict[str, float] = {}
    for site, n in counted.items():
        where, call = site.rsplit(": ", 1)
        key = re.sub(r":\d+ ", " ", where.split(" via ")[0]) + ": " + call
        out[key] = out.get(key, 0) + n / steps
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.timeout(240)
def test_a_step_reads_nothing_from_the_device(layout, small_dataset, tmp_path):
    ranks, overrides, inherent = LAYOUTS[layout]
    run = tmp_path / layout
    args = [*base_overrides(small_dataset, run, steps=4), "train.micro_batch=2", "train.log_every=2", "checkpoint.every=0"]
    check(train([*args, *overrides, "telemetry.host_syncs=true"], nproc=ranks, timeout=200))
    intervals = [r for r in read_metrics(run / "metrics.jsonl", events=True) if r.get("event") == "interval"]
    assert [r["step"] for r in intervals] == [2, 4]
    counted = intervals[-1]["host_syncs"]
    in_steps = {k: v for k, v in counted["sites"].items() if "StepRecorder._read" not in k}
    assert sites(in_steps, 2) == inherent, counted
    assert counted["step"] == 2 * sum(inherent.values()), counted
    assert counted["flush"] == 1 and sites({k: v for k, v in counted["sites"].items() if k not in in_steps}, 1) == FLUSH, counted
