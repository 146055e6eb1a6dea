"""Bad input at the command line, as a user meets it: one line naming the problem and what
is accepted, exit code 2, no traceback, nothing lost, and no rank left waiting."""

from __future__ import annotations

import json

import pytest

from helpers import base_overrides, check, one_line_error, scaletrain, train

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["train", "train.steps=-5"], ["train.steps", "-5", "greater than or equal to 1"]),
        (["train", "nope.yaml"], ["nope.yaml", "not found", "a readable .yaml file"]),
        (["train", "parallel.strategy=magic"], ["parallel.strategy", "'magic'", "'ddp', 'fsdp'"]),
        (["train", "data.paths=/nonexistent/*.txt", "run.device=cpu"], ["data.paths", "/nonexistent/*.txt", "matches no file", "accepted"]),
        (["train", "train.lr_scaling=linear"], ["train.lr_scaling=linear", "train.lr_base_batch"]),
        (["plan", "--gpu", "tpu9"], ["--gpu 'tpu9' is unknown", "accepted: h100"]),
        (["launch", "--nproc", "2", "train.steps=zero"], ["train.steps", "'zero'", "valid integer"]),
        # Checked before any process starts: no rank would find the data either.
        (["launch", "--nproc", "2", "data.paths=/nonexistent/*.txt"], ["data.paths", "/nonexistent/*.txt", "matches no file"]),
    ],
    ids=["value", "file", "choice", "data", "cross-key", "plan", "launch-config", "launch-missing-data"],
)
def test_bad_input_is_one_line_exit_2(tmp_path, args, fragments):
    proc = scaletrain([*args, f"run.dir={tmp_path / 'run'}"] if args[0] != "plan" else args, timeout=120)
    one_line_error(proc, *fragments)
    assert "torch.distributed.run" not in proc.stderr  # for launch: nothing was started


@pytest.mark.timeout(300)
def test_launch_data_broken_only_rank_0_finds_is_one_line_no_hang(tmp_path):
    # Rank 0 alone tokenizes; it meets the bad record while the other rank waits for it.
    # The error reaches that rank as the same clean exit, and the launcher says it once.
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text field"}) + "\n")
    proc = train([f"data.paths={corpus}", f"data.dir={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}", "run.device=cpu"],
                 nproc=2, timeout=180)
    one_line_error(proc, "corpus.jsonl:2", "no field 'text'", "it has: body")


def test_print_config_shows_resolved_values():
    proc = check(scaletrain(["train", "--print-config", "train.steps=42"], timeout=120))
    assert "steps: 42" in proc.stdout


@pytest.mark.timeout(300)
def test_resume_never_refuses_to_overwrite_checkpoints(small_dataset, reference_run):
    proc = train([*base_overrides(small_dataset, reference_run), "train.micro_batch=4", "train.resume=never"])
    one_line_error(proc, "train.resume=never", "already holds checkpoints", "accepted: train.resume=auto")
    assert sorted(p.name for p in (reference_run / "checkpoints").iterdir()) == ["step_10", "step_5"]  # nothing lost


def test_plan_cli_json_and_huggingface_deepspeed_json(tmp_path):
    out = tmp_path / "ds.json"
    proc = check(scaletrain(["plan", "model.preset=8b", "data.seq_len=2048", "precision=bf16", "--gpus-per-node", "8",
                             "--gpu-memory", "80GiB", "--json", "--emit-deepspeed", str(out)], timeout=120))
    plan = json.loads(proc.stdout)
    chosen = next(c for c in plan["candidates"] if c["strategy"] == plan["chosen"])
    assert chosen["fits"] and chosen["memory"]["peak"] <= plan["usable_memory"]
    ds = json.loads(out.read_text())
    # Values HF Trainer owns are "auto" so they can never disagree with TrainingArguments.
    assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["gradient_accumulation_steps"] == "auto"
    assert ds["bf16"]["enabled"] == "auto"
    assert ds["zero_optimization"]["stage"] in (0, 1, 2, 3)
