"""ZeRO-Infinity for real: zero3 with the optimizer and the parameters offloaded to NVMe (a
directory here), at world 2 on CPU/gloo, through DeepSpeed's async_io op (libaio).

Acceptance: the run follows zero3 without offload step for step (loss and grad norm every
step: the standing tolerances of helpers/numerics.py), and DeepSpeed really swapped: the files under
parallel.nvme_path hold exactly the optimizer state, parameters and gradients its swap
rules put there, in the run's dtype, and the optimizer state is what the planner counts as
such. Its checkpoints are DeepSpeed's NVMe layout (masters and moments as raw swap files
in state/zero/offloaded_tensors/), which DeepSpeed 0.19.8 does not resume correctly: the
engine refuses the resume, and the weights are not readable yet (xfail, strict).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.config.parallel import dims_for
from scaletrain.errors import UserError
from scaletrain.models.factory import model_spec
from scaletrain.planning import Setup, estimate

from helpers.launch import check, train
from helpers.numerics import assert_same_steps
from helpers.runs import base_overrides, copy_until, final_weights, metric_rows, run_info

LAUNCH_S = 240
WORLD = 2
VOCAB = 512  # the session's small dataset (conftest.py)

# DeepSpeed swaps only tensors of at least 1 MiB (MIN_AIO_BYTES, runtime/swap_tensor/
# utils.py:14); smaller ones stay in host memory. The tiny preset's largest tensor (65,536
# elements) would leave nothing but its optimizer state on disk, so the feed-forward grows:
# each of its three 256 x 4096 matrices is a 2 MiB fp32 partition per rank, swapped. (Also
# 1 MiB in bf16: DeepSpeed's CPU accelerator used to store them in bf16 in an fp32 run, see
# engines/deepspeed.py, and that shows here as a wrong trajectory, not only as a wrong file.)
SHAPE = ["model.dim=256", "model.ffn_dim=4096", "model.n_layers=1"]
ZERO3 = ["parallel.strategy=zero3", "train.micro_batch=2", *SHAPE]  # global batch 4, as the other engines' tests
MIN_AIO_BYTES = 1 << 20
ALIGN_FP32 = 1024 // 4  # swap lengths round up to AIO_ALIGNED_BYTES (1024) of fp32
# DeepSpeed pins offload_param.buffer_count (5) x buffer_size parameter swap buffers per
# rank, by default 1e8 elements: 2 GB of locked host memory per rank (VmLck, measured) for a
# model whose largest partition is 524,288 elements. 2**20 holds it twice over: 20 MiB.
PARAM_BUFFER = 1 << 20


def _extra(nvme: bool) -> str:
    # Every tensor partitioned (as helpers.Z3_PARTITION_ALL), in both runs alike.
    buffers = f", offload_param: {{buffer_size: {PARAM_BUFFER}}}" if nvme else ""
    return f"parallel.deepspeed_extra={{zero_optimization: {{stage3_param_persistence_threshold: 0{buffers}}}}}"


@pytest.fixture(scope="module")
def runs(small_dataset, tmp_path_factory):
    """(zero3 with nvme offload, zero3 without, the nvme directory): world 2, 10 fp32 steps."""
    root = tmp_path_factory.mktemp("nvme")
    ref, run, swap = root / "zero3", root / "zero3-nvme", root / "swap"
    check(train([*base_overrides(small_dataset, ref), *ZERO3, _extra(False)], nproc=WORLD, timeout=LAUNCH_S))
    nvme = ["parallel.offload_optimizer=nvme", "parallel.offload_params=nvme", f"parallel.nvme_path={swap}"]
    check(train([*base_overrides(small_dataset, run), *ZERO3, *nvme, _extra(True)], nproc=WORLD, timeout=LAUNCH_S))
    return run, ref, swap


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_zero3_with_nvme_offload_matches_zero3_without(runs):
    # Tolerance: the two runs differ only in where the states live (a swap is a byte copy,
    # exact), in the optimizer kernel (DeepSpeedCPUAdam vs the CPU accelerator's FusedAdam:
    # both DeepSpeed's C++ CPU Adam, same arithmetic) and in the order the global grad norm
    # sums its per-partition pieces (fp32 roundoff, ~1e-7 relative). Measured: losses
    # bit-identical, grad norms <= 1.2e-7 apart over 10 steps. The standing tolerances
    # (helpers/numerics.py: loss 1e-5, grad norm 1e-5 at step 1 and 5e-3 later) hold with room, and
    # still catch a parameter stored in bf16 (step-4 loss 9e-5 off): assert_same_steps, the part
    # of assert_same_training without its weights (read from the checkpoint: see the xfail below).
    run, ref, _ = runs
    info = run_info(run)
    assert (info["engine"], info["world_size"], info["backend"], info["device"]) == ("zero3", WORLD, "gloo", "cpu")
    zero = json.loads((run / "deepspeed_config.json").read_text())["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "nvme"
    assert_same_steps(run, ref, 10)


def _partition(numel: int) -> int:
    return math.ceil(numel / WORLD)  # ZeRO-3 pads each tensor to a multiple of the world size


def _aligned(numel: int) -> int:
    return math.ceil(numel / ALIGN_FP32) * ALIGN_FP32


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_swap_files_hold_what_deepspeed_offloads_and_what_the_planner_counts(runs):
    run, _, swap = runs
    cfg = load_config([str(run / "config.yaml")])
    spec = model_spec(cfg, VOCAB)
    params = list(spec.build_meta(cfg.data.seq_len).parameters())  # a tied weight once, as DeepSpeed
    # DeepSpeed's rules (runtime/zero/stage3.py, swap_tensor/): per AdamW group (optim/optimizers.py:
    # matrices decay, vectors do not) one flat fp32 partition per rank, swapped whole when
    # >= 1 MiB as 3 files (master, exp_avg, exp_avg_sq); each parameter partition >= 1 MiB in
    # the run's dtype (fp32) as one file, and its fp32 gradient partition as another.
    groups = [sum(_partition(p.numel()) for p in params if (p.ndim >= 2) == decay) for decay in (True, False)]
    optimizer = sum(3 * 4 * _aligned(g) for g in groups if 4 * g >= MIN_AIO_BYTES)
    big = [4 * _aligned(_partition(p.numel())) for p in params if 4 * _partition(p.numel()) >= MIN_AIO_BYTES]
    assert len(big) == 3  # the feed-forward's three matrices
    for rank in range(WORLD):
        base = swap / "zero_stage_3"
        files = {f.relative_to(base).as_posix(): f.stat().st_size for f in base.rglob("*.swp") if f"rank{rank}" in f.parts}
        params = {k: v for k, v in files.items() if k.startswith(f"float32params/rank{rank}/")}  # the run's dtype
        grads = {k: v for k, v in files.items() if k.startswith("optimizer/") and "_gradient_" in k}
        states = {k: v for k, v in files.items() if k.startswith("optimizer/") and k not in grads}
        assert files.keys() == params.keys() | grads.keys() | states.keys(), sorted(files)  # nothing in another dtype
        assert sum(states.values()) == optimizer, (rank, states)
        assert sorted(params.values()) == sorted(big), (rank, params)
        assert sorted(grads.values()) == sorted(big), (rank, grads)

    # The planner's optimizer state per device (fp32 master + two moments, before offload
    # moves it) is what the NVMe holds of it; only the norms' partitions (<1 MiB) stay in
    # host memory: 384 of 1,737,088 elements per rank here.
    setup = Setup.from_config(cfg, dims_for(cfg.parallel, WORLD))
    planned = estimate(spec, replace(setup, offload_optimizer="none", offload_params="none")).optimizer
    assert abs(optimizer / planned - 1) < 0.01, (optimizer, planned)
    # Its NVMe figure: optimizer state, parameter partitions and their fp32 gradients. It
    # counts every partition as swapped; the ones under 1 MiB (the embedding's and the
    # norms' here: 9% of the parameters) stay on the host, so the files are a little less.
    written = optimizer + 2 * sum(big)
    nvme = estimate(spec, setup).nvme
    assert 0.9 < written / nvme <= 1.0, (written, nvme)


@pytest.mark.unit
def test_nvme_offload_without_libaio_is_a_user_error_naming_the_package(monkeypatch):
    from scaletrain.engines.deepspeed import _import_deepspeed, _require_async_io

    _import_deepspeed(torch.device("cpu"))
    from deepspeed.ops.op_builder.cpu import AsyncIOBuilder

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    with pytest.raises(UserError) as e:
        _require_async_io()
    message = str(e.value)
    assert "\n" not in message and "libaio-dev" in message and "offload to cpu" in message


@pytest.mark.unit
def test_zero3_partitions_in_the_dtype_it_is_given_on_cpu(monkeypatch):
    # DeepSpeed 0.19.8 on its CPU accelerator takes bf16 for any dtype it is given (an
    # operator-precedence slip, see engines/deepspeed.py); its parameter swapper then wrote
    # an fp32 model's partitions in bf16. As on CUDA, the given dtype counts.
    from scaletrain.engines import deepspeed as engine

    engine._import_deepspeed(torch.device("cpu"))
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Init

    monkeypatch.setattr(Init, "_set_dtype", Init._set_dtype)  # restored after the test
    engine._zero3_keeps_the_model_dtype_on_cpu()
    engine._zero3_keeps_the_model_dtype_on_cpu()  # twice: wrapped once
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert Init(enabled=False, dtype=dtype).dtype == dtype


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_resuming_an_nvme_checkpoint_is_refused(small_dataset, runs, tmp_path):
    # DeepSpeed 0.19.8 resumes it wrong (engines/deepspeed.py, load): measured off from the
    # first resumed step. Refused, naming what is accepted, before any step runs.
    run, _, swap = runs
    resumed = tmp_path / "resumed"
    copy_until(run, resumed, step=10)
    nvme = ["parallel.offload_optimizer=nvme", "parallel.offload_params=nvme", f"parallel.nvme_path={swap}"]
    args = [*base_overrides(small_dataset, resumed, steps=12), *ZERO3, *nvme, _extra(True)]
    proc = train(args, nproc=WORLD, timeout=LAUNCH_S)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "written with parallel.offload_optimizer=nvme" in proc.stderr and "accepted: a new run.dir" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(metric_rows(resumed)) == 10  # no step ran


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.xfail(
    strict=True,
    raises=ValueError,
    reason="checkpoint/deepspeed_format.py reads the fp32 masters from zero_pp_rank_*_optim_states.pt, which holds "
    "none of the NVMe-swapped groups: DeepSpeed keeps them in state/zero/offloaded_tensors/rank*/ (zero_to_fp32: "
    "'consumed 3474176 numels out of 768')",
)
def test_nvme_checkpoint_weights_are_readable(runs):
    # When the reader learns the layout this passes, and strict xfail fails: then compare
    # the weights with the run without offload (helpers.numerics.assert_weights_close) here.
    run, _, _ = runs
    assert final_weights(run, 10)
