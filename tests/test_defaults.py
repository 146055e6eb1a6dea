"""What a run gets without flags on its device (training/defaults.py, docs/gpu.md's table): a key
the user set stays theirs; on a CPU nothing changes; on a GPU each default is applied
for its reason and said in the run's first lines."""

from __future__ import annotations

import json

import pytest

import scaletrain.training.trainer as trainer
from scaletrain.config import AUTO_MICRO_BATCH, load_config
from scaletrain.training import defaults
from scaletrain.training.defaults import Target

from helpers.launch import check, scaletrain
from helpers.runs import base_overrides

GPU = Target("cuda", "NVIDIA H100 80GB HBM3", bf16=True)


def resolved(overrides: list[str], target: Target = GPU, vocab: int = 128256, dp: int = 2):
    cfg = load_config([], overrides)
    return defaults.before_plan(cfg, target, vocab, dp, defaults.unset(cfg))


@pytest.mark.unit
def test_on_a_gpu_the_unset_keys_take_the_devices_defaults():
    cfg, applied = resolved([])
    assert cfg.precision == "bf16"
    # 2**28 logits per chunk at a 128256 vocabulary: 2093 positions, the power of two below.
    assert cfg.train.loss_chunk_tokens == 2048 == defaults.chunk_tokens(128256)
    # The planner's largest micro-batch at the global batch the config's micro-batch gave.
    assert cfg.train.micro_batch == AUTO_MICRO_BATCH and cfg.train.global_batch == 16 * 2
    assert [a.split("=")[0] for a in applied] == ["precision", "train.loss_chunk_tokens", "train.micro_batch"]


@pytest.mark.unit
def test_a_key_the_user_set_stays_and_a_cpu_changes_nothing():
    mine = ["precision=fp32", "train.micro_batch=4", "train.loss_chunk_tokens=0", "train.compile=false"]
    cfg, applied = resolved(mine)
    assert (cfg.precision, cfg.train.micro_batch, cfg.train.loss_chunk_tokens, applied) == ("fp32", 4, 0, [])
    plain = load_config([], [])
    cfg, applied = resolved([], Target("cpu"))
    assert cfg == plain and applied == []
    cfg, _ = resolved(["train.global_batch=64"])  # a global batch of the user's is kept
    assert cfg.train.global_batch == 64 and cfg.train.micro_batch == AUTO_MICRO_BATCH


@pytest.mark.unit
def test_small_vocabularies_keep_the_whole_loss_and_old_gpus_get_fp16():
    cfg, _ = resolved([], Target("cuda", "Tesla V100", bf16=False), vocab=32000)
    assert cfg.precision == "fp16" and cfg.train.loss_chunk_tokens == 0


@pytest.mark.unit
def test_checkpointing_only_where_nothing_fits_and_compile_where_it_pays():
    free = defaults.unset(load_config([], []))
    fits_only_checkpointed = lambda c: (c.parallel.activation_checkpointing, 0.5)  # noqa: E731
    # 200 steps of 0.5 s: 18% saves 18 s, less than ~20 s of compiling.
    cfg, applied = defaults.after_plan(load_config([], ["train.steps=200"]), GPU, free, fits_only_checkpointed, lambda c: True)
    assert cfg.parallel.activation_checkpointing and not cfg.train.compile
    assert applied[0].startswith("parallel.activation_checkpointing=true") and applied[1].startswith("train.compile=false")
    # Selective checkpointing where it fits (it repeats less), full where only that fits, and the
    # mode a user set kept.
    assert cfg.parallel.ac_mode == "selective" and "parallel.ac_mode=selective" in applied[0]
    fits_only_full = lambda c: (c.parallel.activation_checkpointing and c.parallel.ac_mode == "full", 0.5)  # noqa: E731
    cfg, applied = defaults.after_plan(load_config([], ["train.steps=200"]), GPU, free, fits_only_full, lambda c: True)
    assert cfg.parallel.activation_checkpointing and cfg.parallel.ac_mode == "full" and "(full:" in applied[0]
    full = load_config([], ["train.steps=200", "parallel.ac_mode=full"])
    cfg, applied = defaults.after_plan(full, GPU, defaults.unset(full), fits_only_checkpointed, lambda c: True)
    assert cfg.parallel.activation_checkpointing and cfg.parallel.ac_mode == "full"
    # 10000 steps: 900 s saved.
    cfg, applied = defaults.after_plan(load_config([], ["train.steps=10000"]), GPU, free, lambda c: (True, 0.5), lambda c: True)
    assert cfg.train.compile and not cfg.parallel.activation_checkpointing and applied[0].startswith("train.compile=true")
    # A layout that does not offer compile, a CPU, a key the user set: nothing.
    for cfg0, target, allowed in (("train.steps=10000", GPU, False), ("train.steps=10000", Target("cpu"), True)):
        cfg, applied = defaults.after_plan(load_config([], [cfg0]), target, free, lambda c: (True, 0.5), lambda c, ok=allowed: ok)
        assert not cfg.train.compile and applied == []
    mine = load_config([], ["train.steps=10000", "train.compile=false", "parallel.activation_checkpointing=false"])
    cfg, applied = defaults.after_plan(mine, GPU, defaults.unset(mine), fits_only_checkpointed, lambda c: True)
    assert not cfg.train.compile and not cfg.parallel.activation_checkpointing and applied == []


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_run_says_which_defaults_it_applied(small_dataset, tmp_path, monkeypatch, capsys):
    # The device made to look like a GPU (the run itself stays on the CPU, in bf16): the
    # first lines name every default applied, and the resolved config holds them.
    monkeypatch.setattr(trainer, "runtime_target", lambda world: GPU)
    run = tmp_path / "run"
    small = ["model.vocab_size=65536", "data.seq_len=32", "train.global_batch=4"]  # bf16 on a CPU is slow
    trainer.train(load_config([], [*base_overrides(small_dataset, run, steps=2), *small]))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("defaults: ")]
    assert [line.split("=")[0] for line in lines] == [
        "defaults: precision",
        "defaults: train.loss_chunk_tokens",
        "defaults: train.micro_batch",
        "defaults: train.compile",
    ], out
    saved = load_config([run / "config.yaml"], [])
    assert saved.precision == "bf16" and saved.train.loss_chunk_tokens == 4096 and not saved.train.compile
    assert saved.train.global_batch == 4 and saved.train.micro_batch * saved.train.grad_accum == 4


@pytest.mark.e2e
def test_plan_names_the_defaults_and_plans_with_them_when_asked():
    base = ["plan", "--gpus-per-node", "1", "--configured-only", "--json", "model.preset=1b", "data.seq_len=2048"]
    base += ["model.vocab_size=128256", "parallel.strategy=fsdp", "train.steps=3000"]
    plain = json.loads(check(scaletrain(base)).stdout)
    planned = json.loads(check(scaletrain([*base, "--device-defaults"])).stdout)
    # As configured (fp32, micro-batch 16) the 1b does not fit an H100; with the defaults it
    # does, at bf16 and the largest micro-batch dividing the global batch of 16.
    assert not plain["candidates"][0]["fits"] and planned["candidates"][0]["fits"]
    assert any("train applies on such a GPU" in n and "precision=bf16" in n for n in plain["notes"])
    said = next(n for n in planned["notes"] if n.startswith("planned with the device's defaults"))
    assert "train.micro_batch=auto" in said and "train.compile=true" in said
