"""Bad input at the command line, as a user meets it: one line naming the problem and what
is accepted, exit code 2, no traceback, nothing lost, and no rank left waiting."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from scaletrain.cli import main

from helpers.launch import check, one_line_error, run, scaletrain, train
from helpers.runs import SMALL_CORPUS, base_overrides, eval_overrides, metric_rows, run_info

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["train", "train.steps=-5"], ["train.steps", "-5", "greater than or equal to 1"]),
        (["train", "nope.yaml"], ["nope.yaml", "not found", "a readable .yaml file"]),
        (["train", "parallel.strategy=magic"], ["parallel.strategy", "'magic'", "'ddp', 'fsdp'"]),
        (
            ["train", "data.paths=/nonexistent/*.txt", "run.device=cpu"],
            ["data.paths", "/nonexistent/*.txt", "matches no file", "accepted"],
        ),
        (["train", "train.lr_scaling=linear"], ["train.lr_scaling=linear", "train.lr_base_batch"]),
        (["plan", "--gpu", "tpu9"], ["--gpu 'tpu9' is unknown", "accepted: h100"]),
        (["launch", "--nproc", "2", "train.steps=zero"], ["train.steps", "'zero'", "valid integer"]),
        # Checked before any process starts: no rank would find the data either.
        (["launch", "--nproc", "2", "data.paths=/nonexistent/*.txt"], ["data.paths", "/nonexistent/*.txt", "matches no file"]),
        (["train", "eval.every=4", "eval.split=0"], ["eval.every=4", "eval.split=0", "accepted: eval.split in (0, 1)"]),
        (["launch", "--nproc", "2", "eval", "/nonexistent/run"], ["eval /nonexistent/run: no such run or checkpoint"]),
    ],
    ids=["value", "file", "choice", "data", "cross-key", "plan", "launch-config", "launch-missing-data", "eval", "launch-eval"],
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
    proc = train(
        [f"data.paths={corpus}", f"data.dir={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}", "run.device=cpu"],
        nproc=2,
        timeout=180,
    )
    one_line_error(proc, "corpus.jsonl:2", "no field 'text'", "it has: body")


def test_print_config_shows_resolved_values():
    proc = check(scaletrain(["train", "--print-config", "train.steps=42"], timeout=120))
    assert "steps: 42" in proc.stdout


@pytest.mark.parametrize(
    "interleaved, grouped",
    [
        (
            ["plan", "model.preset=8b", "--gpus-per-node", "8", "data.seq_len=4096", "--json"],
            ["plan", "--gpus-per-node", "8", "--json", "model.preset=8b", "data.seq_len=4096"],
        ),
        (
            ["train", "data.seq_len=32", "--print-config", "model.preset=small"],
            ["train", "--print-config", "data.seq_len=32", "model.preset=small"],
        ),
        (
            ["launch", "--nproc", "1", "data.seq_len=32", "--max-restarts", "0", "train.steps=1", "--dry-run"],
            ["launch", "--nproc", "1", "--max-restarts", "0", "--dry-run", "data.seq_len=32", "train.steps=1"],
        ),
    ],
    ids=["plan", "train", "launch"],
)
def test_overrides_go_anywhere_on_the_line(capsys, interleaved, grouped):
    """Options between overrides: every override is taken, in the order written, as if grouped."""
    outputs = []
    for argv in (interleaved, grouped, grouped[:-1]):  # the last: one override fewer, so the output tells them apart
        assert main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] != outputs[2]


def test_an_unknown_option_among_overrides_is_still_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "train.steps=2", "--bogus", "model.preset=small"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_resume_never_refuses_to_overwrite_checkpoints(small_dataset, reference_run):
    proc = train([*base_overrides(small_dataset, reference_run), "train.micro_batch=4", "train.resume=never"])
    one_line_error(proc, "train.resume=never", "already holds checkpoints", "accepted: train.resume=auto")
    assert sorted(p.name for p in (reference_run / "checkpoints").iterdir()) == ["step_10", "step_5"]  # nothing lost


def test_plan_cli_json_and_huggingface_deepspeed_json(tmp_path):
    out = tmp_path / "ds.json"
    proc = check(
        scaletrain(
            [
                "plan",
                "model.preset=8b",
                "data.seq_len=2048",
                "precision=bf16",
                "--gpus-per-node",
                "8",
                "--gpu-memory",
                "80GiB",
                "--json",
                "--emit-deepspeed",
                str(out),
            ],
            timeout=120,
        )
    )
    plan = json.loads(proc.stdout)
    chosen = next(c for c in plan["candidates"] if c["strategy"] == plan["chosen"])
    assert chosen["fits"] and chosen["memory"]["peak"] <= plan["usable_memory"]
    ds = json.loads(out.read_text())
    # Values HF Trainer owns are "auto" so they can never disagree with TrainingArguments.
    assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["gradient_accumulation_steps"] == "auto"
    assert ds["bf16"]["enabled"] == "auto"
    assert ds["zero_optimization"]["stage"] in (0, 1, 2, 3)


# Resuming with a config that would make the saved state mean something else: refused
# before anything is allocated, in one line that names the key and both values.
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "override, fragments",
    [
        ("model.dim=256", ["model.dim is 256", "trained with 128", "accepted: model.dim=128"]),
        ("data.seq_len=32", ["data.seq_len is 32", "trained with 64", "accepted: data.seq_len=64"]),
        ("train.seed=7", ["train.seed is 7", "trained with 1234"]),
        # Another held-out split: the training stream skips other documents.
        ("eval.split=0.1", ["eval.split is 0.1", "trained with 0.0", "accepted: eval.split=0.0"]),
    ],
    ids=["shape", "seq_len", "seed", "eval_split"],
)
def test_resume_that_changes_the_meaning_of_the_state_is_one_line(small_dataset, reference_run, override, fragments):
    before = sorted(p.name for p in reference_run.iterdir())
    proc = train([*base_overrides(small_dataset, reference_run, steps=12), "train.micro_batch=4", override])
    one_line_error(proc, "step_10", *fragments)
    assert sorted(p.name for p in reference_run.iterdir()) == before  # nothing written


@pytest.mark.timeout(300)
def test_resume_with_safe_changes_continues_and_says_what_changed(small_dataset, reference_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference_run, run)
    proc = check(
        train(
            [
                *base_overrides(small_dataset, run, steps=12),
                "train.micro_batch=4",
                "train.lr=1e-3",
                "parallel.strategy=fsdp",
                "checkpoint.every=6",
                *eval_overrides(small_dataset),  # as the reference's: no change
            ]
        )
    )
    assert "resume: step_10 was written by ddp; fsdp loads it through torch.distributed.checkpoint" in proc.stdout
    assert (
        "resume: changed since step_10: checkpoint.every 5 -> 6, parallel.strategy 'ddp' -> 'fsdp', train.lr 0.003 -> 0.001, train.steps 10 -> 12"
        in proc.stdout
    )
    assert run_info(run)["resumed_from"].endswith("step_10") and run_info(run)["engine"] == "fsdp"
    assert [r["step"] for r in metric_rows(run)] == list(range(1, 13))


def test_config_file_that_is_not_utf8_is_one_line(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("train:\n  steps: 3  # r\xe9sum\xe9\n".encode("latin-1"))
    one_line_error(
        scaletrain(["train", str(bad)], timeout=60),
        "latin1.yaml",
        "is not UTF-8 text",
        "byte 0xe9",
        "accepted: a UTF-8 YAML file",
    )


def test_nccl_on_a_machine_without_cuda_is_one_line(tmp_path):
    one_line_error(
        scaletrain(["train", "parallel.backend=nccl", "run.device=cpu", f"run.dir={tmp_path}"], timeout=60),
        "parallel.backend=nccl needs CUDA devices",
        "accepted on CPU: parallel.backend=gloo or auto",
    )


def test_plan_of_a_named_strategy_emits_that_strategy(tmp_path):
    # The planner would pick fsdp or zero3 for 8B on 8 x 80 GiB; zero2 was asked for.
    out = tmp_path / "ds.json"
    proc = check(
        scaletrain(
            [
                "plan",
                "model.preset=8b",
                "data.seq_len=2048",
                "precision=bf16",
                "parallel.strategy=zero2",
                "--json",
                "--emit-deepspeed",
                str(out),
            ],
            timeout=120,
        )
    )
    plan = json.loads(proc.stdout)
    assert plan["chosen_strategy"] == "zero2" and plan["reasons"][0].startswith("zero2 as configured")
    assert len(plan["candidates"]) > 1  # the others, for comparison
    assert json.loads(out.read_text())["zero_optimization"]["stage"] == 2


# Strategies DeepSpeed does not run are written as the DeepSpeed strategy that partitions
# the same states: fsdp (parameters, gradients, optimizer) as ZeRO-3, ddp (nothing) as stage 0.
@pytest.mark.parametrize("strategy, stage", [("ddp", 0), ("fsdp", 3), ("zero1", 1)])
def test_plan_emits_the_deepspeed_counterpart_of_the_chosen_strategy(tmp_path, capsys, strategy, stage):
    out = tmp_path / "ds.json"
    args = ["plan", "model.preset=tiny", f"parallel.strategy={strategy}", "--gpus-per-node", "2", "--json"]
    assert main([*args, "--emit-deepspeed", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["chosen_strategy"] == strategy
    assert json.loads(out.read_text())["zero_optimization"]["stage"] == stage


# `scaletrain --help` and a bad command line are answered before torch is imported (0.1 s,
# not 1 s and more): the command modules import light modules only; what a command runs,
# its `run` imports.
BEFORE_TORCH = """
import sys
from scaletrain.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:  # --help
    code = e.code
if "torch" in sys.modules:
    print("torch was imported", file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize(
    "args, code",
    [
        (["--help"], 0),
        (["train", "model.nope=1"], 2),
        (["launch", "--nproc", "2", "train.steps=zero"], 2),
        (["plan", "--measure", "parallel.strategy=auto"], 2),
        (["bench", "--strategies", "ddp,zero9"], 2),
        (["bench", "--suite", "checkpoint", "--peers"], 2),
    ],
    ids=["help", "train", "launch", "plan-measure", "bench", "bench-suite"],
)
def test_help_and_bad_input_are_answered_before_torch_is_imported(args, code):
    proc = run([sys.executable, "-c", BEFORE_TORCH, *args], timeout=60)
    assert proc.returncode == code and "torch was imported" not in proc.stderr, proc.stderr[-2000:]


# Rank 0 alone tokenizes; the others wait on the store, not in a collective.
@pytest.mark.timeout(300)
def test_rank_0_too_slow_to_prepare_data_is_one_line_not_a_hang(tmp_path):
    # The embedded default corpus takes rank 0 several seconds to tokenize; rank 1 waits 1 s.
    proc = train(
        [f"data.dir={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}", "run.device=cpu", "data.prepare_timeout_s=1"],
        nproc=2,
        timeout=180,
    )
    one_line_error(proc, "rank 0 did not finish preparing the data within 1 s", "accepted: a larger data.prepare_timeout_s")


@pytest.mark.timeout(300)
def test_rank_0_crash_while_preparing_data_reaches_the_other_rank(tmp_path):
    # A crash, not bad input (a data.dir that cannot be made is refused before any work, in
    # one line): rank 0's preparation raises as a full disk or a bug in a tokenizer would,
    # injected through a sitecustomize module on the ranks' path.
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(CRASH_RANK_0_PREPARING)
    proc = train(
        [f"data.paths={SMALL_CORPUS[0]}", f"data.dir={tmp_path / 'cache'}", f"run.dir={tmp_path / 'run'}", "run.device=cpu"],
        nproc=2,
        timeout=180,
        env={"PYTHONPATH": str(inject)},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "scaletrain: error: rank 0 failed while preparing the data (NotADirectoryError" in proc.stderr
    assert "rank 0 (pid" in proc.stderr and "failed with exit code 1" in proc.stderr


# RANK is read at the call, not at start-up: the launcher's ranks may be forked from its
# agent (launch/forked.py), which ran this at its own start, before any rank existed.
CRASH_RANK_0_PREPARING = """
import os
import scaletrain.data.prepare as prepare

prepare_dataset = prepare.prepare_dataset

def crash(*args, **kwargs):
    if os.environ.get("RANK") == "0":
        raise NotADirectoryError(20, "Not a directory", "injected")
    return prepare_dataset(*args, **kwargs)

prepare.prepare_dataset = crash
"""


# The `scaletrain` process ends with os._exit (the interpreter's teardown of torch cost
# 0.6 s per process), but only after what a normal exit does first: a thread that is not a
# daemon finishes, atexit handlers run, the output is flushed, the exit code is kept.
END_OF_PROCESS = """
import atexit, sys, threading, time
from pathlib import Path
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done"))).start()
# An idle pool left open, as torch.compile leaves one: its workers are not daemons and
# leave only once threading's shutdown callbacks told them to (a bare join hung forever).
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(2)
pool.submit(time.sleep, 0).result()
sys.argv = ["scaletrain", "train", "--print-config", "train.steps=7"]
from scaletrain.cli import main
main()
raise SystemExit(5)  # not reached: main() ended the process with the command's own code
"""


@pytest.mark.timeout(60)
def test_the_process_ends_after_threads_atexit_and_output(tmp_path):
    proc = run([sys.executable, "-c", END_OF_PROCESS, str(tmp_path)], timeout=30)  # a hang: killed, exit -9
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "steps: 7" in proc.stdout
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran"
