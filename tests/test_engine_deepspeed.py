"""DeepSpeed ZeRO engine: the generated JSON (pure), then the CLI on 2-3 ranks (CPU/gloo).

Acceptance: every ZeRO variant follows the single-process trajectory (loss and grad norm
every step, weights per tensor; tolerances in helpers/numerics.py) and resumes bit-exactly after a
SIGKILL, fp16 included after DeepSpeed's loss scale moved; bf16/fp16 train; ZeRO-3 works
on 3 ranks with sizes 3 does not divide; DeepSpeed itself, built from the saved JSON at
world 2, runs with the settings the config asked for; a deepspeed_extra key that
contradicts our config is a clean error.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import pytest

from scaletrain.config import load_config
from scaletrain.engines.deepspeed_config import build_deepspeed_config, merge_extra, to_json
from scaletrain.engines.deepspeed_ops import clear_stale_locks
from scaletrain.errors import UserError

from helpers.launch import check, one_line_error, probe, scaletrain, train
from helpers.numerics import assert_bit_exact, assert_hf_export_matches, assert_same_training, assert_scale_moved
from helpers.runs import FP16_MOVING_SCALE, Z3_PARTITION_ALL, base_overrides, copy_until, eval_overrides, metric_rows, run_info


def cfg_of(*overrides: str):
    return load_config([], ["run.device=cpu", *overrides])


# ---------------------------------------------------------------- pure: no processes


@pytest.mark.unit
@pytest.mark.parametrize("strategy,stage", [("zero1", 1), ("zero2", 2), ("zero3", 3)])
def test_generated_config_carries_our_settings(strategy, stage):
    cfg = cfg_of(
        f"parallel.strategy={strategy}",
        "train.micro_batch=3",
        "train.grad_accum=5",
        "train.clip_grad=0.5",
        "train.lr=2e-3",
        "train.adam_beta1=0.8",
        "train.adam_beta2=0.9",
        "train.adam_eps=1e-7",
        "train.weight_decay=0.05",
        "parallel.bucket_size=1234",
    )
    ds = build_deepspeed_config(cfg, dp_size=4)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 5
    assert ds["train_batch_size"] == 3 * 5 * 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.8, 0.9], "eps": 1e-7, "weight_decay": 0.05}}
    assert "scheduler" not in ds  # the engine sets our schedule's lr every step
    assert ds["fp16"] == {"enabled": False} and ds["bf16"] == {"enabled": False}
    zero = ds["zero_optimization"]
    assert zero["stage"] == stage and zero["reduce_bucket_size"] == 1234
    assert zero.get("allgather_bucket_size" if stage < 3 else "stage3_prefetch_bucket_size") == 1234
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    assert ds["steps_per_print"] >= 10**6 and ds["wall_clock_breakdown"] is False
    assert json.loads(to_json(ds)) == ds


@pytest.mark.unit
def test_precision_and_offload_sections():
    fp16 = build_deepspeed_config(cfg_of("parallel.strategy=zero2", "precision=fp16", "train.clip_grad=0"), 2)
    assert fp16["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    assert fp16["bf16"] == {"enabled": False} and fp16["gradient_clipping"] == 0.0
    bf16 = build_deepspeed_config(cfg_of("parallel.strategy=zero3", "precision=bf16"), 2)
    assert bf16["bf16"] == {"enabled": True} and bf16["fp16"] == {"enabled": False}

    cpu = build_deepspeed_config(
        cfg_of("parallel.strategy=zero3", "parallel.offload_optimizer=cpu", "parallel.offload_params=cpu"), 2
    )["zero_optimization"]
    assert cpu["offload_optimizer"] == {"device": "cpu", "pin_memory": False}  # pinning only helps a GPU
    assert cpu["offload_param"] == {"device": "cpu", "pin_memory": False}
    nvme = build_deepspeed_config(
        load_config(
            [], ["run.device=cuda", "parallel.strategy=zero3", "parallel.offload_optimizer=nvme", "parallel.nvme_path=/nvme"]
        ),
        8,
    )["zero_optimization"]
    assert nvme["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme"}
    assert "offload_param" not in nvme
    scaled = build_deepspeed_config(
        cfg_of("parallel.strategy=zero2", "precision=fp16", "train.loss_scale_init=1024", "train.loss_scale_window=7"), 2
    )
    assert scaled["fp16"]["initial_scale_power"] == 10 and scaled["fp16"]["loss_scale_window"] == 7


@pytest.mark.unit
def test_merge_extra_adds_new_keys_and_accepts_equal_ones():
    generated = {"a": 1, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    merged = merge_extra(generated, {"zero_optimization": {"stage": 2, "round_robin_gradients": True}, "b": {"c": 1}})
    assert merged == {
        "a": 1,
        "b": {"c": 1},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "round_robin_gradients": True},
    }
    assert generated == {"a": 1, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}  # untouched
    assert merge_extra({"betas": [0.9, 0.95]}, {"betas": (0.9, 0.95)}) == {"betas": [0.9, 0.95]}


@pytest.mark.unit
@pytest.mark.parametrize(
    "extra,dotted,ours,theirs,hint",
    [
        ({"train_micro_batch_size_per_gpu": 7}, "train_micro_batch_size_per_gpu", "2", "7", "change train.micro_batch instead"),
        ({"gradient_clipping": 0}, "gradient_clipping", "1.0", "0", "change train.clip_grad instead"),
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage", "2", "3", "change parallel.strategy instead"),
        (
            {"optimizer": {"params": {"betas": [0.9, 0.999]}}},
            "optimizer.params.betas",
            "[0.9, 0.95]",
            "[0.9, 0.999]",
            "train.adam_beta1 / train.adam_beta2",
        ),
        ({"bf16": {"enabled": True}}, "bf16.enabled", "false", "true", "change precision instead"),
        ({"wall_clock_breakdown": True}, "wall_clock_breakdown", "false", "true", "remove it from parallel.deepspeed_extra"),
        ({"zero_optimization": 3}, "zero_optimization", '"stage"', "3", "remove it"),
    ],
)
def test_conflicting_extra_key_names_key_values_and_our_key(extra, dotted, ours, theirs, hint):
    cfg = cfg_of("parallel.strategy=zero2", "train.micro_batch=2")
    with pytest.raises(UserError) as e:
        build_deepspeed_config(cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"deepspeed_extra": extra})}), 2)
    message = str(e.value)
    assert "\n" not in message and f"parallel.deepspeed_extra.{dotted} = {theirs}" in message
    assert ours in message and hint in message


# ---------------------------------------------------------------- end to end, CLI

LAUNCH_S = 240


@pytest.mark.unit
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the holders of a lock are read from /proc")
def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_held_one_kept(tmp_path, monkeypatch):
    # A killed DeepSpeed op build leaves `<op>/lock`; every later build waits on it forever
    # (a CI run hung so). A live build keeps its lock open, and that one must stay. So must
    # a lock made just now and not yet seen open: a build that took the path between the
    # listing and the reading of /proc (removing it failed a CI run).
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    a_minute_ago = time.time() - 60
    for op in ("fused_adam", "cpu_adam", "shm_comm"):
        (tmp_path / op).mkdir()
        (tmp_path / op / "lock").touch()
        if op != "shm_comm":
            os.utime(tmp_path / op / "lock", (a_minute_ago, a_minute_ago))
    held = os.open(tmp_path / "cpu_adam" / "lock", os.O_RDONLY)
    try:
        assert clear_stale_locks() == [(tmp_path / "fused_adam" / "lock").resolve()]
        assert not (tmp_path / "fused_adam" / "lock").exists()
        assert (tmp_path / "cpu_adam" / "lock").exists()
        assert (tmp_path / "shm_comm" / "lock").exists()
    finally:
        os.close(held)


@pytest.mark.unit
def test_a_virtual_environment_keeps_its_own_op_cache():
    # The tests run from the project's .venv: its ops cache must be inside it, not the
    # per-user one that other checkouts share.
    assert sys.prefix != sys.base_prefix
    assert os.environ["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")


@pytest.mark.unit
def test_deepspeed_import_leaves_torch_compile_as_it_was():
    # Its Muon module is imported with torch.compile made a no-op (start-up cost, see
    # engines/deepspeed.py); torch.compile itself must be torch's again afterwards.
    import torch

    from scaletrain.engines.deepspeed import _import_deepspeed

    compile_ = torch.compile
    _import_deepspeed(torch.device("cpu"))
    assert torch.compile is compile_
    assert "deepspeed.runtime.zero.muon.original_muon" in sys.modules


@pytest.fixture(scope="module")
def zero_runs(small_dataset, tmp_path_factory):
    """case -> its straight run (world 2, 10 steps, a checkpoint every 5), made on first use."""
    made = {}

    def get(case: str):
        if case not in made:
            run = tmp_path_factory.mktemp(case) / "straight"
            args = [*base_overrides(small_dataset, run), *CASES[case], "checkpoint.every=5", *eval_overrides(small_dataset)]
            check(train(args, nproc=2, timeout=LAUNCH_S))
            made[case] = run
        return made[case]

    return get


# Same global batch of 4 as the reference: 2 ranks x 2, or 2 ranks x 1 x 2 accumulated.
CASES = {
    "zero1_accum": ["parallel.strategy=zero1", "train.micro_batch=1", "train.grad_accum=2"],
    "zero2": ["parallel.strategy=zero2", "train.micro_batch=2"],
    # + activation checkpointing: recomputation under ZeRO-3 re-gathers each block's shards.
    "zero3_accum_ac": [
        "parallel.strategy=zero3",
        "train.micro_batch=1",
        "train.grad_accum=2",
        Z3_PARTITION_ALL,
        "parallel.activation_checkpointing=true",
    ],
    "zero2_offload_optimizer": ["parallel.strategy=zero2", "train.micro_batch=2", "parallel.offload_optimizer=cpu"],
    "zero3_offload_params": ["parallel.strategy=zero3", "train.micro_batch=2", "parallel.offload_params=cpu", Z3_PARTITION_ALL],
}


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_zero_matches_one_process(reference_run, zero_runs, case):
    run = zero_runs(case)
    info = run_info(run)
    assert (info["engine"], info["world_size"], info["backend"]) == (CASES[case][0].split("=")[1], 2, "gloo")
    assert info["versions"]["deepspeed"] == "0.19.8"
    assert_same_training(run, reference_run)
    # The exact JSON is in the run directory and beside every checkpoint.
    saved = (run / "deepspeed_config.json").read_text()
    assert saved == to_json(build_deepspeed_config(load_config([str(run / "config.yaml")]), 2))
    for step in (5, 10):
        assert (run / "checkpoints" / f"step_{step}" / "deepspeed_config.json").read_text() == saved


# Resume where the checkpoint formats differ: ZeRO-3's parameter partitions (+
# recomputation) here; ZeRO-1 and 2 share one optimizer class and its partitioned format,
# resumed by the fp16 ZeRO-2 test below. A fresh process continues from the straight
# run's step 5 (what a run killed after step 7 does, without running the kill:
# test_train_equivalence.py and test_reshard.py kill for real).
@pytest.mark.dist
@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", ["zero3_accum_ac"])
def test_zero_run_resumes_bit_exactly(small_dataset, zero_runs, tmp_path, case):
    straight, resumed = zero_runs(case), tmp_path / "resumed"
    copy_until(straight, resumed, step=5)
    args = [*base_overrides(small_dataset, resumed), *CASES[case], "checkpoint.every=5", *eval_overrides(small_dataset)]
    check(train(args, nproc=2, timeout=LAUNCH_S))
    assert run_info(resumed)["resumed_from"].endswith("step_5")
    assert_bit_exact(resumed, straight, 10)


# Export reads DeepSpeed's partitions through its universal converter: ZeRO-3's flat
# per-parameter files, with activation checkpointing's wrapper in the names.
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_zero3_checkpoint_exports_to_hugging_face(zero_runs, tmp_path):
    run, out = zero_runs("zero3_accum_ac"), tmp_path / "hf"
    check(scaletrain(["ckpt", "export", str(run), str(out), "--dtype", "fp32"]))
    assert_hf_export_matches(run / "checkpoints" / "step_10", out)


FP16_ZERO2 = [
    "parallel.strategy=zero2",
    "train.micro_batch=2",
    "parallel.offload_optimizer=cpu",
    "train.clip_grad=0.7",
    "checkpoint.every=5",
    *FP16_MOVING_SCALE,
]


@pytest.fixture(scope="module")
def fp16_zero2_run(small_dataset, tmp_path_factory):
    run = tmp_path_factory.mktemp("fp16-zero2") / "straight"
    check(train([*base_overrides(small_dataset, run), *FP16_ZERO2], nproc=2, timeout=LAUNCH_S))
    return run


@pytest.mark.dist
@pytest.mark.timeout(500)
def test_fp16_zero2_offload_resumes_bit_exactly_after_the_loss_scale_moved(small_dataset, fp16_zero2_run, tmp_path):
    assert_scale_moved(fp16_zero2_run)
    resumed = tmp_path / "resumed"
    copy_until(fp16_zero2_run, resumed, step=5)  # as a kill after step 7 leaves it
    check(train([*base_overrides(small_dataset, resumed), *FP16_ZERO2], nproc=2, timeout=LAUNCH_S))
    assert_bit_exact(resumed, fp16_zero2_run, 10)  # losses, loss_scale and skipped of every step
    trainer = json.loads((resumed / "checkpoints" / "step_10" / "trainer.json").read_text())
    assert trainer["engine_state"]["loss_scale"] == metric_rows(resumed)[-1]["loss_scale"]


# What DeepSpeed itself runs with when built from the saved file at world 2, against what
# the config asked for (written out here, not recomputed by the function that wrote it).
LIVE = {
    "fp16_zero2_offload": dict(
        stage=2,
        offload_optimizer="cpu",
        offload_param=None,
        optimizer="DeepSpeedCPUAdam",
        scheduler=False,
        gradient_clipping=0.7,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=1,
        train_batch_size=4,
        world_size=2,
        fp16=True,
        bf16=False,
        param_dtype="torch.float16",
        loss_scale=2.0**20,
        initial_scale_power=20,
        loss_scale_window=2,
        hysteresis=2,
    ),
    "zero3_offload_params": dict(
        stage=3,
        offload_optimizer=None,
        offload_param="cpu",
        optimizer="FusedAdam",
        scheduler=False,
        gradient_clipping=1.0,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=1,
        train_batch_size=4,
        world_size=2,
        fp16=False,
        bf16=False,
        param_dtype="torch.float32",
    ),
}


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_deepspeed_built_from_the_saved_json_runs_with_our_settings(fp16_zero2_run, zero_runs, tmp_path):
    runs = {case: fp16_zero2_run if case == "fp16_zero2_offload" else zero_runs(case) for case in LIVE}
    files = [str(runs[case] / "deepspeed_config.json") for case in LIVE]
    ranks = probe("deepspeed_from_json", files, tmp_path, nproc=2, timeout=LAUNCH_S)  # both files, one launch
    for live in ranks:
        assert dict(zip(LIVE, live)) == LIVE


@pytest.mark.dist
@pytest.mark.slow  # 27-56 s under the suite's load (bf16 matmuls are emulated on CPUs without bf16 units)
@pytest.mark.timeout(400)
def test_bf16_trains(small_dataset, tmp_path):
    # bf16 over 12 steps; fp16 trains in the resume test above (ZeRO-2, a moving loss scale),
    # and test_precision.py checks both precisions' forward (bf16 compute, fp32 masters) and
    # fp16 overflow on ZeRO-2 and 3 in every `make test`; this one runs in `make test-slow`.
    run = tmp_path / "run"
    check(
        train(
            [*base_overrides(small_dataset, run, steps=12), "parallel.strategy=zero2", "train.micro_batch=2", "precision=bf16"],
            nproc=2,
            timeout=LAUNCH_S,
        )
    )
    rows = metric_rows(run)
    assert len(rows) == 12 and all(np.isfinite(r["loss"]) for r in rows)
    assert np.mean([r["loss"] for r in rows[-3:]]) < rows[0]["loss"] - 0.3
    assert json.loads((run / "deepspeed_config.json").read_text())["bf16"]["enabled"] is True
    assert all("loss_scale" not in r for r in rows)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_conflicting_extra_key_is_one_line_exit_2(small_dataset, tmp_path):
    proc = train(
        [
            *base_overrides(small_dataset, tmp_path / "run", steps=2),
            "parallel.strategy=zero2",
            "train.micro_batch=2",
            "parallel.deepspeed_extra={train_micro_batch_size_per_gpu: 7}",
        ]
    )
    one_line_error(proc, "parallel.deepspeed_extra.train_micro_batch_size_per_gpu = 7", "train.micro_batch")


@pytest.mark.unit
def test_py_cpuinfos_answer_is_asked_once_per_machine(tmp_path, monkeypatch):
    """DeepSpeed's op loads ask py-cpuinfo (a Python subprocess, ~1 s) for -march and the
    SIMD width: the answer is kept on disk per machine, and a later process (here: the
    function wrapped again, as a new process would) reads it instead of asking."""
    import cpuinfo

    from scaletrain.engines import deepspeed as ds

    monkeypatch.setenv("SCALETRAIN_CACHE", str(tmp_path))
    asked = []
    fake = {"arch": "X86_64", "flags": ["avx2", "fma"], "brand_raw": "a CPU"}
    for _ in range(2):  # two "processes"
        monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: asked.append(1) or dict(fake))
        ds._skip_unneeded_start_costs()
        assert cpuinfo.get_cpu_info() == fake and cpuinfo.get_cpu_info() == fake
    assert len(asked) == 1
    key = ds._cpu_key(cpuinfo.CPUINFO_VERSION_STRING)
    assert key is not None and any(line.startswith("flags") for line in key) and not any("MHz" in line for line in key)
