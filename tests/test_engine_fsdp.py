"""Acceptance: the FSDP2 engine trains exactly like one process, in every sharding mode.

Runs go through the CLI (torchrun, gloo on CPU), as users run them. Launches are the
cost here, so one prepared dataset, one single-process reference and one plain fsdp run
are shared by the tests whose global batch matches.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from scaletrain import checkpoint
from scaletrain.telemetry import read_metrics
from train_helpers import base_overrides, check, final_weights, losses, run_scaletrain

FSDP = "parallel.strategy=fsdp"


@pytest.fixture(scope="module")
def prepared(small_dataset):
    return small_dataset


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run


@pytest.fixture(scope="module")
def fsdp_run(prepared, tmp_path_factory):
    """Full shard at world 2 (2 x 2 samples), checkpointing every 5 steps for the resume test."""
    run = tmp_path_factory.mktemp("fsdp") / "run"
    proc = check(run_scaletrain(["train", *base_overrides(prepared, run), FSDP, "train.micro_batch=2", "checkpoint.every=5"], nproc=2))
    assert "fsdp | world 2 x cpu (gloo)" in proc.stdout
    return run


def grad_norms(run_dir: Path) -> list[float]:
    return [r["grad_norm"] for r in read_metrics(run_dir / "metrics.jsonl")]


def assert_matches(run: Path, ref: Path, weights_atol: float = 1e-6) -> None:
    a, b = losses(ref), losses(run)
    assert len(a) == len(b) == 10
    np.testing.assert_allclose(b, a, rtol=1e-4)
    assert a[-1] < a[0]  # it trained, not just agreed
    # The clipped norm is the global one, not this rank's shard's.
    np.testing.assert_allclose(grad_norms(run), grad_norms(ref), rtol=1e-3)
    # Key equality: wrappers (activation checkpointing, FSDP) leave parameter names unchanged.
    wa, wb = final_weights(ref, 10), final_weights(run, 10)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=weights_atol, msg=lambda m: f"{k}: {m}")
    if "output.weight" in wb:  # tiny preset: tied, so the head must still equal the embedding
        assert torch.equal(wb["output.weight"], wb["tok_embeddings.weight"])


@pytest.mark.timeout(300)
def test_fsdp_world_2_matches_one_process(reference, fsdp_run):
    assert_matches(fsdp_run, reference)


@pytest.mark.timeout(300)
def test_fsdp_without_torchrun_with_cpu_offload_matches_one_process(prepared, reference, tmp_path):
    # One process, no launcher: the engine makes its own single-rank group (fully_shard needs
    # one). Offloading parameters on one device is what FSDP at world 1 is for.
    run = tmp_path / "one"
    args = ["train", *base_overrides(prepared, run), FSDP, "train.micro_batch=4", "parallel.offload_params=cpu"]
    proc = check(run_scaletrain(args))
    assert "fsdp | world 1 x cpu" in proc.stdout and "Warning" not in proc.stderr
    assert_matches(run, reference)


@pytest.mark.timeout(300)
def test_killed_fsdp_run_resumes_bit_exactly(prepared, fsdp_run, tmp_path):
    killed = tmp_path / "killed"
    args = ["train", *base_overrides(prepared, killed), FSDP, "train.micro_batch=2", "checkpoint.every=5"]
    proc = run_scaletrain(args, nproc=2, env={"SCALETRAIN_KILL_AT_STEP": "7"})
    assert proc.returncode != 0  # one rank SIGKILLed itself; torchrun tears the job down
    assert [s for s, _ in checkpoint.complete_checkpoints(killed / "checkpoints")] == [5]

    proc = check(run_scaletrain(args, nproc=2))
    assert "resuming from" in proc.stdout and "step_5" in proc.stdout
    assert losses(killed) == losses(fsdp_run)  # exact float equality, all 10 steps
    a, b = final_weights(killed, 10), final_weights(fsdp_run, 10)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_world_3_with_uneven_shards_matches_one_process(prepared, tmp_path):
    # 515 vocabulary rows, ffn 200, dim 128 and 64 kv rows: no sharded dimension divides by 3,
    # so every rank's shard is padded differently.
    shape = ["model.vocab_size=515", "model.ffn_dim=200"]
    single, fsdp = tmp_path / "single", tmp_path / "fsdp"
    check(run_scaletrain(["train", *base_overrides(prepared, single), *shape, "train.micro_batch=3"]))
    check(run_scaletrain(["train", *base_overrides(prepared, fsdp), *shape, FSDP, "train.micro_batch=1"], nproc=3))
    assert final_weights(fsdp, 10)["tok_embeddings.weight"].shape == (515, 128)
    # Averaging over 3 ranks is not exact in floating point (over 2 it is); Adam's division by
    # sqrt(v) lifts that noise on near-zero gradients to ~2e-5 in a few weights after 10 steps.
    # DDP at world 3 differs from one process by the same amount.
    assert_matches(fsdp, single, weights_atol=5e-5)


# variant -> (overrides, weights atol). Accumulation sums 2 half-batch means instead of one
# mean: ~1e-9 gradient noise that Adam lifts to ~1e-6 on near-zero entries (as for DDP).
VARIANTS = {
    # Shard-grad-op, with accumulation: non-boundary micro-batches skip the reduce-scatter.
    "shard_grad_op_accum": (["train.micro_batch=1", "train.grad_accum=2", "parallel.reshard_after_forward=false"], 1e-5),
    # Hybrid on a 2 x 1 mesh (replicate x shard), with accumulation: skips the all-reduce.
    "hybrid_2x1_accum": (["train.micro_batch=1", "train.grad_accum=2", "parallel.dp_replicate=2"], 1e-5),
    "activation_checkpointing": (["train.micro_batch=2", "parallel.activation_checkpointing=true"], 1e-6),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharding_variant_matches_one_process(prepared, reference, tmp_path, variant):
    overrides, atol = VARIANTS[variant]
    run = tmp_path / variant
    check(run_scaletrain(["train", *base_overrides(prepared, run), FSDP, *overrides], nproc=2))
    assert_matches(run, reference, weights_atol=atol)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(prepared, tmp_path, precision):
    run = tmp_path / precision
    check(run_scaletrain(["train", *base_overrides(prepared, run, steps=12), FSDP, "train.micro_batch=2", f"precision={precision}"], nproc=2))
    rows = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 12 and all(np.isfinite(r["loss"]) for r in rows)
    assert np.mean([r["loss"] for r in rows[-3:]]) < rows[0]["loss"] - 0.3
    if precision == "fp16":
        assert all(r["loss_scale"] > 0 for r in rows)  # dynamic loss scale is logged each step
    else:
        assert all("loss_scale" not in r for r in rows)


def launch_ranks(argv: list[str], nproc: int, out_dir: Path, timeout: float = 120) -> list[tuple[int, str, str]]:
    """Start the ranks as plain processes with the launcher's environment, without torchrun:
    torchrun folds every worker's exit code into its own 1 and prints its own traceback,
    while these tests check what each scaletrain process itself does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, files = [], []
    try:
        for r in range(nproc):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            out, err = out_dir / f"rank{r}.out", out_dir / f"rank{r}.err"
            files.append((out, err))
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(subprocess.Popen([sys.executable, *argv], stdout=fo, stderr=fe, env=env, text=True))
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(c, o.read_text(), e.read_text()) for c, (o, e) in zip(codes, files)]


@pytest.mark.timeout(180)
def test_bad_dp_replicate_is_a_one_line_error(prepared, tmp_path):
    args = ["-m", "scaletrain", "train", *base_overrides(prepared, tmp_path / "run"), FSDP, "parallel.dp_replicate=3"]
    (c0, _, err0), (c1, _, err1) = launch_ranks(args, nproc=2, out_dir=tmp_path)
    assert (c0, c1) == (2, 2), (err0, err1)
    lines = err0.strip().splitlines()
    assert len(lines) == 1, err0
    assert "parallel.dp_replicate=3" in lines[0] and "world size 2" in lines[0] and "accepted: 1, 2" in lines[0]
    assert "Traceback" not in err0 + err1


# In-process checks on a model small enough to build in a blink: the tie survives sharding,
# wrapper names never reach the state dict, and an fp16 overflow on ONE rank skips the step
# on ALL ranks (found_inf is reduced across the mesh).
ENGINE_PROBE = r"""
import json, torch
from scaletrain.config import load_config
from scaletrain.distributed import init_distributed, shutdown
from scaletrain.engines.fsdp import FSDPEngine
from scaletrain.models import build_meta_model, build_model, loss_fn, materialize, resolve_shape

cfg = load_config(overrides=["parallel.strategy=fsdp", "precision=fp16", "parallel.activation_checkpointing=true",
                             "model.vocab_size=67", "model.dim=32", "model.n_layers=2", "model.n_heads=2",
                             "model.n_kv_heads=1", "model.ffn_dim=48"])
world = init_distributed("cpu", "gloo")
shape = resolve_shape(cfg.model)
engine = FSDPEngine(build_meta_model(shape, 16), world, cfg, lambda m, device: materialize(m, device, 7))
m = engine.model
out = {"tied": m.output.weight is m.tok_embeddings.weight}
full = engine.full_weights()
if world.rank == 0:
    plain = build_model(shape, 16, seed=7).state_dict()
    out["keys_match"] = sorted(full) == sorted(plain)
    out["init_match"] = out["keys_match"] and all(torch.equal(full[k], plain[k]) for k in plain)

def step(poison):
    tokens = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(world.rank))
    with engine.accumulate(boundary=True):
        with engine.autocast():
            loss = loss_fn(m(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
    if poison:
        m.layers[0].attention.wq.weight.grad.to_local().view(-1)[0] = float("inf")
    before = [p.to_local().clone() for p in m.parameters()]
    stats = engine.step(1e-2)
    changed = any(not torch.equal(b, p.to_local()) for b, p in zip(before, m.parameters()))
    return {"skipped": stats.skipped, "scale": stats.loss_scale, "changed": changed}

out["overflow_on_rank_1"] = step(poison=world.rank == 1)
out["clean"] = step(poison=False)
print(json.dumps(out))
shutdown(world)
"""


@pytest.mark.timeout(180)
def test_engine_probe_tie_names_and_fp16_overflow_agreement(tmp_path):
    results = launch_ranks(["-c", ENGINE_PROBE], nproc=2, out_dir=tmp_path)
    for code, out, err in results:
        assert code == 0, err
    r0, r1 = (json.loads(out.strip().splitlines()[-1]) for _, out, _ in results)
    assert r0["tied"] and r1["tied"]
    assert r0["keys_match"] and r0["init_match"]  # full_weights == the unsharded model's state dict
    for r in (r0, r1):
        assert r["overflow_on_rank_1"] == {"skipped": True, "scale": 32768.0, "changed": False}
        assert r["clean"] == {"skipped": False, "scale": 32768.0, "changed": True}
