"""DeepSpeed ZeRO engine: the generated JSON (pure), then the CLI under torchrun on CPU/gloo.

Acceptance: every ZeRO variant follows the single-process DDP trajectory (rtol 1e-4, fp32)
and resumes bit-exactly after a SIGKILL; bf16/fp16 train (fp16 logs DeepSpeed's loss
scale); ZeRO-3 works on 3 ranks with sizes 3 does not divide; the saved JSON is what the
engine runs with, and a deepspeed_extra key that contradicts our config is a clean error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain import checkpoint
from scaletrain.config import load_config
from scaletrain.engines.deepspeed_config import build_deepspeed_config, merge_extra, to_json
from scaletrain.errors import UserError
from train_helpers import base_overrides, check, final_weights, losses, run_scaletrain

# The tiny model's tensors are all below DeepSpeed's default persistence threshold (1e5
# elements), so ZeRO-3 would keep every one of them whole on every rank; 0 makes it really
# partition them. It is also a non-conflicting deepspeed_extra key, merged in.
Z3_PARTITION_ALL = "parallel.deepspeed_extra={zero_optimization: {stage3_param_persistence_threshold: 0}}"


def cfg_of(*overrides: str):
    return load_config([], ["run.device=cpu", *overrides])


# ---------------------------------------------------------------- pure: no processes


@pytest.mark.timeout(30)
@pytest.mark.parametrize("strategy,stage", [("zero1", 1), ("zero2", 2), ("zero3", 3)])
def test_generated_config_carries_our_settings(strategy, stage):
    cfg = cfg_of(
        f"parallel.strategy={strategy}", "train.micro_batch=3", "train.grad_accum=5", "train.clip_grad=0.5",
        "train.lr=2e-3", "train.adam_beta1=0.8", "train.adam_beta2=0.9", "train.adam_eps=1e-7",
        "train.weight_decay=0.05", "parallel.bucket_size=1234",
    )
    ds = build_deepspeed_config(cfg, world_size=4)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 5
    assert ds["train_batch_size"] == 3 * 5 * 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"] == {
        "type": "AdamW", "params": {"lr": 2e-3, "betas": [0.8, 0.9], "eps": 1e-7, "weight_decay": 0.05}
    }
    assert "scheduler" not in ds  # the engine sets our schedule's lr every step
    assert ds["fp16"] == {"enabled": False} and ds["bf16"] == {"enabled": False}
    zero = ds["zero_optimization"]
    assert zero["stage"] == stage and zero["reduce_bucket_size"] == 1234
    assert zero.get("allgather_bucket_size" if stage < 3 else "stage3_prefetch_bucket_size") == 1234
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    assert ds["steps_per_print"] >= 10**6 and ds["wall_clock_breakdown"] is False
    assert json.loads(to_json(ds)) == ds


@pytest.mark.timeout(30)
def test_precision_and_offload_sections():
    fp16 = build_deepspeed_config(cfg_of("parallel.strategy=zero2", "precision=fp16", "train.clip_grad=0"), 2)
    assert fp16["fp16"] == {
        "enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
        "hysteresis": 2, "min_loss_scale": 1,
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
        load_config([], ["run.device=cuda", "parallel.strategy=zero3", "parallel.offload_optimizer=nvme",
                         "parallel.nvme_path=/nvme"]), 8,
    )["zero_optimization"]
    assert nvme["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme"}
    assert "offload_param" not in nvme


@pytest.mark.timeout(30)
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


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "extra,dotted,ours,theirs,hint",
    [
        ({"train_micro_batch_size_per_gpu": 7}, "train_micro_batch_size_per_gpu", "2", "7", "change train.micro_batch instead"),
        ({"gradient_clipping": 0}, "gradient_clipping", "1.0", "0", "change train.clip_grad instead"),
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage", "2", "3", "change parallel.strategy instead"),
        ({"optimizer": {"params": {"betas": [0.9, 0.999]}}}, "optimizer.params.betas", "[0.9, 0.95]", "[0.9, 0.999]",
         "train.adam_beta1 / train.adam_beta2"),
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

# The first run on a machine JIT-builds DeepSpeed's CPU ops (comm, fused_adam, cpu_adam:
# about 5 minutes in all on 2 cores, then cached in ~/.cache/torch_extensions), inside
# whichever test comes first: hence limits far above the ~5-40 s these tests take warm.
LAUNCH_S = 420


@pytest.fixture(scope="module")
def prepared(small_dataset):
    return small_dataset


@pytest.fixture(scope="module")
def reference(reference_run):
    """The trajectory and final weights every 2-rank ZeRO run must follow."""
    return losses(reference_run), final_weights(reference_run, 10)


def ds_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return final_weights(run, step)  # read_model_weights dispatches to DeepSpeed's reader


def assert_weights_close(got: dict, want: dict) -> None:
    """Each tensor within 1e-4 relative (Frobenius) of the reference.

    Not elementwise: the reduction order differs (partitions, ranks, accumulation), and Adam
    divides by sqrt(v), which lifts ~1e-9 noise on a near-zero gradient to ~1e-5 in that one
    weight; whole tensors agree to ~2e-5 at worst here (measured), a real bug is far off.
    """
    assert got.keys() == want.keys()
    for k in got:
        rel = ((got[k] - want[k]).norm() / want[k].norm()).item()
        assert rel < 1e-4, f"{k}: relative difference {rel:.2e}"


# Same global batch of 4 as the reference: 2 ranks x 2, or 2 ranks x 1 x 2 accumulated
# (which also checks the accumulation boundary and that the loss is not divided twice).
CASES = {
    "zero1_accum": ["parallel.strategy=zero1", "train.micro_batch=1", "train.grad_accum=2"],
    "zero2": ["parallel.strategy=zero2", "train.micro_batch=2"],
    # + activation checkpointing: recomputation under ZeRO-3 re-gathers each block's shards.
    "zero3_accum_ac": ["parallel.strategy=zero3", "train.micro_batch=1", "train.grad_accum=2", Z3_PARTITION_ALL,
                       "parallel.activation_checkpointing=true"],
    "zero2_offload_optimizer": ["parallel.strategy=zero2", "train.micro_batch=2", "parallel.offload_optimizer=cpu"],
    "zero3_offload_params": ["parallel.strategy=zero3", "train.micro_batch=2", "parallel.offload_params=cpu", Z3_PARTITION_ALL],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_zero_matches_one_process_and_resumes_bit_exactly(prepared, reference, tmp_path, case):
    ref_losses, ref_weights = reference
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    args = [*CASES[case], "checkpoint.every=5"]
    proc = check(run_scaletrain(["train", *base_overrides(prepared, straight), *args], nproc=2, timeout=LAUNCH_S))
    assert f"{args[0].split('=')[1]} | world 2 x cpu (gloo)" in proc.stdout

    # fp32: the same trajectory as one process on the same global batch.
    np.testing.assert_allclose(losses(straight), ref_losses, rtol=1e-4)
    assert_weights_close(ds_weights(straight, 10), ref_weights)

    # The exact JSON is in the run directory and beside every checkpoint, and it is what
    # our config generates for this world size (deepspeed_extra included).
    saved = (straight / "deepspeed_config.json").read_text()
    assert saved == to_json(build_deepspeed_config(load_config([str(straight / "config.yaml")]), 2))
    for step in (5, 10):
        assert (straight / "checkpoints" / f"step_{step}" / "deepspeed_config.json").read_text() == saved

    # SIGKILL after step 7 (torchrun then fails), resume from step 5: identical to the straight run.
    proc = run_scaletrain(["train", *base_overrides(prepared, killed), *args], nproc=2, env={"SCALETRAIN_KILL_AT_STEP": "7"})
    assert proc.returncode != 0
    assert [s for s, _ in checkpoint.complete_checkpoints(killed / "checkpoints")] == [5]
    proc = check(run_scaletrain(["train", *base_overrides(prepared, killed), *args], nproc=2))
    assert "resuming from" in proc.stdout and "step_5" in proc.stdout
    assert losses(killed) == losses(straight)  # exact float equality, all 10 steps
    a, b = ds_weights(killed, 10), ds_weights(straight, 10)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(600)
# Both precisions and both stage families of the one DeepSpeed engine, in two runs (CI time).
@pytest.mark.parametrize("strategy, precision", [("zero2", "bf16"), ("zero3", "fp16")])
def test_mixed_precision_trains(prepared, tmp_path, strategy, precision):
    run = tmp_path / "run"
    extra = [Z3_PARTITION_ALL] if strategy == "zero3" else []
    check(run_scaletrain(
        ["train", *base_overrides(prepared, run, steps=12), f"parallel.strategy={strategy}", "train.micro_batch=2",
         f"precision={precision}", *extra], nproc=2, timeout=LAUNCH_S,
    ))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(np.isfinite(r["loss"]) for r in rows)
    assert np.mean([r["loss"] for r in rows[-3:]]) < rows[0]["loss"] - 0.3
    assert json.loads((run / "deepspeed_config.json").read_text())[precision]["enabled"] is True
    if precision == "fp16":  # DeepSpeed's dynamic scaler: logged every step, saved in its checkpoint
        assert all(r["loss_scale"] > 0 and r["skipped"] in (True, False) for r in rows)
        assert not rows[-1]["skipped"]
        trainer = json.loads((run / "checkpoints" / "step_12" / "trainer.json").read_text())
        assert trainer["engine"]["loss_scale"] == rows[-1]["loss_scale"]
    else:
        assert all("loss_scale" not in r for r in rows)


@pytest.mark.timeout(600)
def test_zero3_on_three_ranks_with_sizes_three_does_not_divide(prepared, tmp_path):
    # vocab 512 (the tokenizer's), dim 136, ffn 392: no tensor splits evenly over 3 ranks.
    shape = ["model.dim=136", "model.ffn_dim=392"]
    single, zero3 = tmp_path / "single", tmp_path / "zero3"
    check(run_scaletrain(["train", *base_overrides(prepared, single, steps=6), *shape, "train.micro_batch=3"]))
    proc = check(run_scaletrain(
        ["train", *base_overrides(prepared, zero3, steps=6), *shape, "train.micro_batch=1", "parallel.strategy=zero3",
         Z3_PARTITION_ALL], nproc=3, timeout=LAUNCH_S,
    ))
    assert "zero3 | world 3 x cpu (gloo)" in proc.stdout
    np.testing.assert_allclose(losses(zero3), losses(single), rtol=1e-4)
    got = ds_weights(zero3, 6)
    assert got["tok_embeddings.weight"].shape == (512, 136)
    assert_weights_close(got, final_weights(single, 6))


@pytest.mark.timeout(120)
def test_conflicting_extra_key_is_one_line_exit_2(prepared, tmp_path):
    run = tmp_path / "run"
    proc = run_scaletrain([
        "train", *base_overrides(prepared, run, steps=2), "parallel.strategy=zero2", "train.micro_batch=2",
        "parallel.deepspeed_extra={train_micro_batch_size_per_gpu: 7}",
    ])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert "train_micro_batch_size_per_gpu" in lines[0] and "7" in lines[0] and "train.micro_batch" in lines[0]


# One process, no launcher and no process group: the engine builds its own group of one.
# Reports DeepSpeed's live settings in the JSON's own shape, the optimizer it chose, one
# step's stats, and whether the weights the engine gathers equal what
# read_deepspeed_weights reads back from its checkpoint.
LIVE_PROBE = r"""
import json, math, sys
from pathlib import Path
import torch, torch.distributed as dist
from scaletrain.config import load_config
from scaletrain.distributed import init_distributed
from scaletrain.engines import build_engine
from scaletrain.engines.deepspeed import read_deepspeed_weights
from scaletrain.models import build_meta_model, loss_fn, materialize, resolve_shape

cfg = load_config([], sys.argv[2:])
world = init_distributed("cpu")
assert not world.distributed and not dist.is_initialized()
engine = build_engine(build_meta_model(resolve_shape(cfg.model, 300), 16), world, cfg, lambda m, d: materialize(m, d, 0))
ds, opt, z = engine.ds, engine.ds.basic_optimizer, engine.ds._config.zero_config
x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
for boundary in (False, True):
    with engine.accumulate(boundary), engine.autocast():
        loss = loss_fn(engine.model(x), x)
    engine.backward(loss / 2)
stats = engine.step(1e-3)
engine.save(Path(sys.argv[1]))
saved, full = read_deepspeed_weights(Path(sys.argv[1])), engine.full_weights()
fp16 = {"enabled": ds.fp16_enabled()}
if ds.fp16_enabled():
    init, window, hysteresis, _, min_scale = ds.dynamic_loss_scale_args().values()
    fp16 |= dict(loss_scale=ds.loss_scale(), initial_scale_power=int(math.log2(init)), loss_scale_window=window,
                 hysteresis=hysteresis, min_loss_scale=min_scale)
zero = dict(stage=int(z.stage), reduce_bucket_size=z.reduce_bucket_size, overlap_comm=z.overlap_comm,
            contiguous_gradients=z.contiguous_gradients)
if z.stage < 3:
    zero["allgather_bucket_size"] = z.allgather_bucket_size
else:
    zero |= dict(stage3_prefetch_bucket_size=z.prefetch_bucket_size, stage3_param_persistence_threshold=z.param_persistence_threshold)
if z.offload_optimizer:
    zero["offload_optimizer"] = {"device": str(getattr(z.offload_optimizer.device, "value", z.offload_optimizer.device))}
print("REPORT " + json.dumps({
    "json": engine.checkpoint_files()["deepspeed_config.json"],
    "live": dict(
        train_micro_batch_size_per_gpu=ds.train_micro_batch_size_per_gpu(), gradient_accumulation_steps=ds.gradient_accumulation_steps(),
        train_batch_size=ds.train_batch_size(), gradient_clipping=ds.gradient_clipping(), optimizer={"params": ds.optimizer_params()},
        fp16=fp16, bf16={"enabled": ds.bfloat16_enabled()}, zero_optimization=zero, steps_per_print=ds.steps_per_print(),
        wall_clock_breakdown=ds.wall_clock_breakdown(),
    ),
    "optimizer": [ds.optimizer_name(), type(opt).__name__, ds.lr_scheduler is not None],
    "groups": [[g["lr"], list(g["betas"]), g["eps"], g["weight_decay"]] for g in opt.param_groups],
    "stats": [float(stats.grad_norm), stats.loss_scale, stats.skipped],
    "weights": [len(saved), saved.keys() == full.keys() and all(torch.equal(saved[k], full[k]) for k in saved)],
}))
"""


def pick(tree, like):
    """The part of `tree` with the keys of `like`, at every level."""
    return {k: pick(tree[k], v) for k, v in like.items()} if isinstance(like, dict) else tree


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "overrides,optimizer_class",
    [
        (["parallel.strategy=zero2", "precision=fp16", "parallel.offload_optimizer=cpu"], "DeepSpeedCPUAdam"),
        (["parallel.strategy=zero3", "precision=bf16", Z3_PARTITION_ALL], "FusedAdam"),
    ],
)
def test_saved_json_is_what_the_engine_runs_with(tmp_path, overrides, optimizer_class):
    args = ["model.preset=tiny", "run.device=cpu", "data.seq_len=16", "train.micro_batch=2", "train.grad_accum=2",
            "train.clip_grad=0.7", "parallel.bucket_size=100000", *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", LIVE_PROBE, str(tmp_path / "state"), *args], capture_output=True,
                          text=True, timeout=LAUNCH_S, env=env | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.split("REPORT ", 1)[1])
    assert report["json"] == to_json(build_deepspeed_config(load_config([], args), 1))
    saved = json.loads(report["json"])
    # Every setting DeepSpeed reports back equals the saved JSON's (the extra key included).
    assert report["live"] == pick(saved, report["live"])
    assert saved["zero_optimization"].get("stage3_param_persistence_threshold", 0) == 0
    # DeepSpeed's own optimizer with our decay grouping and the lr we set; no DS scheduler.
    assert report["optimizer"] == [saved["optimizer"]["type"].lower(), optimizer_class, False]
    assert report["groups"] == [[1e-3, [0.9, 0.95], 1e-8, 0.1], [1e-3, [0.9, 0.95], 1e-8, 0.0]]
    grad_norm, loss_scale, skipped = report["stats"]
    assert np.isfinite(grad_norm) and grad_norm > 0 and skipped is False
    assert loss_scale == (2.0**16 if "precision=fp16" in overrides else None)
    assert report["weights"] == [39, True]  # 38 tensors + the tied output head; fp32 masters agree
