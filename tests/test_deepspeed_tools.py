"""DeepSpeed's and torch's own tools on scaletrain's checkpoints, as their users run them,
and DeepSpeed's ops built once whichever ninja comes first on PATH (issue 31).

One short run per engine at world 2 (2 steps, a checkpoint at step 2), made on first use
and shared by the module's tests.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scaletrain.checkpoint.hf_export import hf_name
from scaletrain.cli import main
from scaletrain.models.params import canonical_name

from helpers.launch import check, run, scaletrain, train
from helpers.runs import Z3_PARTITION_ALL, base_overrides, copy_until, metric_rows, run_info

LAUNCH_S = 240
STEPS = 2
CKPT = f"checkpoints/step_{STEPS}"
SCRIPTS = Path(sysconfig.get_path("scripts"))  # the environment's bin: its python, its ninja
# The two PATH orders of the issue: the environment first (an activated venv, a bench, a
# test), and the system's first (`.venv/bin/scaletrain` typed in a plain shell).
ENV_FIRST = os.pathsep.join([str(SCRIPTS), "/usr/local/bin", "/usr/bin", "/bin"])
SYSTEM_FIRST = os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"])

CASES = {
    "zero1": ["parallel.strategy=zero1", "train.micro_batch=2"],
    "zero2": ["parallel.strategy=zero2", "train.micro_batch=2"],
    # The tiny model's tensors are all below ZeRO-3's persistence threshold: 0 really partitions them.
    "zero3": ["parallel.strategy=zero3", "train.micro_batch=2", Z3_PARTITION_ALL],
    "fsdp": ["parallel.strategy=fsdp", "train.micro_batch=2"],
}


@pytest.fixture(scope="module")
def runs(small_dataset, tmp_path_factory):
    """case -> its run directory (world 2, 2 steps, a checkpoint at step 2), made on first use,
    with the environment first on PATH (the ops test starts from these builds)."""
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            rundir = tmp_path_factory.mktemp(case) / "run"
            args = [*base_overrides(small_dataset, rundir, steps=STEPS), *CASES[case], f"checkpoint.every={STEPS}"]
            check(train(args, nproc=2, timeout=LAUNCH_S, env={"PATH": ENV_FIRST}))
            made[case] = rundir
        return made[case]

    return get


def fp32_export(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    proc = check(scaletrain(["ckpt", "export", str(ckpt), str(out), "--format", "hf", "--dtype", "fp32"]))
    assert "fp32 (the checkpoint's weights exactly)" in proc.stdout, proc.stdout
    return load_file(str(out / "model.safetensors"))


def as_hf(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """A state dict of our module names under Hugging Face names, the tied output projection
    (`lm_head`, which the export leaves out: config.json says tie_word_embeddings) checked
    equal to the embedding and dropped."""
    named = {hf_name(canonical_name(k.removeprefix(prefix))): v for k, v in state.items() if k.startswith(prefix)}
    tied = named.pop("lm_head.weight", None)
    if tied is not None:
        assert torch.equal(tied, named["model.embed_tokens.weight"])
    return named


def assert_equal_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype == torch.float32, k
        assert torch.equal(got[k], want[k]), k  # both are the fp32 masters, copied, never computed


def in_dir(directory: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """`cd DIRECTORY && ARGV`, as a user types it (through helpers.launch.run: a timeout, no stray process)."""
    return run(["sh", "-c", f"cd {shlex.quote(str(directory))} && {shlex.join(argv)}"], timeout=120)


# ------------------------------------------------------------------ DeepSpeed's zero_to_fp32


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["zero1", "zero2", "zero3"])
def test_deepspeeds_zero_to_fp32_run_in_state_equals_the_fp32_export(runs, tmp_path, case):
    ckpt = runs(case) / CKPT
    state = ckpt / "state"
    # DeepSpeed's pointer to the tag, inside the atomic write: the manifest covers it.
    assert (state / "latest").read_text() == "zero"
    assert "state/latest" in json.loads((ckpt / "COMPLETE").read_text())["files"]
    # DeepSpeed's documented use, with no flags: the script it copied there, its tag from `latest`.
    check(in_dir(state, [sys.executable, "zero_to_fp32.py", ".", str(tmp_path / "ds")]))
    theirs = torch.load(tmp_path / "ds" / "pytorch_model.bin", map_location="cpu", weights_only=True)
    assert_equal_tensors(as_hf(theirs), fp32_export(ckpt, tmp_path / "hf"))


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_checkpoint_without_latest_still_resumes_and_exports(small_dataset, runs, tmp_path):
    # As written before `latest` existed: no file, no manifest entry.
    straight, old = runs("zero2"), tmp_path / "old"
    copy_until(straight, old, step=STEPS)
    ckpt = old / CKPT
    (ckpt / "state" / "latest").unlink()
    marker = json.loads((ckpt / "COMPLETE").read_text())
    del marker["files"]["state/latest"]
    (ckpt / "COMPLETE").write_text(json.dumps(marker))
    assert_equal_tensors(fp32_export(ckpt, tmp_path / "hf-old"), fp32_export(straight / CKPT, tmp_path / "hf"))
    args = [*base_overrides(small_dataset, old, steps=STEPS + 1), *CASES["zero2"], f"checkpoint.every={STEPS}"]
    check(train(args, nproc=2, timeout=LAUNCH_S))
    assert run_info(old)["resumed_from"].endswith(f"step_{STEPS}")
    assert [r["step"] for r in metric_rows(old)] == list(range(1, STEPS + 2))


# ------------------------------------------------------------------ torch's dcp_to_torch_save


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_torchs_dcp_to_torch_save_reads_an_fsdp_state_as_the_fp32_export(runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = runs("fsdp") / CKPT
    dcp_to_torch_save(str(ckpt / "state"), str(tmp_path / "state.pt"))
    saved = torch.load(tmp_path / "state.pt", map_location="cpu", weights_only=False)
    flat = saved if "model" not in saved else {f"model.{k}": v for k, v in saved["model"].items()}
    assert_equal_tensors(as_hf(flat, prefix="model."), fp32_export(ckpt, tmp_path / "hf"))


# ------------------------------------------------------------------ device-hours


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_diagnose_and_compare_count_cpu_hours_on_a_cpu_run(runs, capsys):
    rundir = runs("zero2")
    assert run_info(rundir)["device"] == "cpu"
    assert main(["diagnose", str(rundir), "--json", "--no-html"]) == 0
    (summary,) = [f for f in json.loads(capsys.readouterr().out) if f["code"] == "summary"]
    assert any(e.endswith(" CPU-hours") for e in summary["evidence"]), summary["evidence"]
    assert main(["compare", str(rundir), str(runs("zero1"))]) == 0
    text = capsys.readouterr().out
    assert "CPU-hours per 1B tokens" in text and "GPU" not in text, text


# ------------------------------------------------------------------ ops built once


def op_logs() -> dict[str, str]:
    """Each built op's ninja log: a build that runs appends to it (a ninja that rejects the
    log's version starts it over), so an op not rebuilt leaves it as it was."""
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    return {p.parent.name: p.read_text() for p in sorted(root.glob("*/.ninja_log"))}


def ninja_version(path: str) -> str:
    return subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_deepspeed_ops_are_not_rebuilt_when_another_ninja_comes_first(small_dataset, runs, tmp_path):
    ours, theirs = str(SCRIPTS / "ninja"), shutil.which("ninja", path=SYSTEM_FIRST)
    # `make setup-test` installs Debian's ninja-build (1.11 beside the environment's 1.13) where
    # apt is usable: elsewhere this fails saying what to install, as the other system packages' tests do.
    assert theirs is not None and ninja_version(theirs) != ninja_version(ours), (
        f"no second ninja of another version than {ours} ({ninja_version(ours)}) on PATH {SYSTEM_FIRST}: install "
        "Debian's ninja-build (make setup-test does as root)"
    )
    runs("zero2")  # built (if it had to be) with the environment first on PATH
    before = op_logs()
    assert {"deepspeed_shm_comm", "fused_adam"} <= before.keys(), sorted(before)  # what a CPU zero2 run loads
    rundir = tmp_path / "system-first"
    args = [*base_overrides(small_dataset, rundir, steps=1), *CASES["zero2"]]
    check(train(args, nproc=2, timeout=LAUNCH_S, env={"PATH": SYSTEM_FIRST}))
    after = op_logs()
    changed = [op for op in before if after.get(op) != before[op]]
    assert not changed, f"rebuilt with {theirs} first on PATH: {changed}"
