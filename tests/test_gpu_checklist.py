"""scripts/gpu_checklist.py: its list of checks, --list and its budget, and CPU mode for real
(GPU mode against faked processes: test_gpu_checklist_faked.py).

The GPU parts need a GPU this machine lacks, so: the declarative list is checked against the issue's
order (the environment, five engines in bf16, the 1b preset's micro-batch and runs, four planner
configurations, other issues' checks, then what runs when time is left), every check with an expected
time; `--list` prints every exact command, its expected time, the running total and the one line where
a budget cuts, and runs nothing; and the CPU mode runs end to end as the lent machine runs it
(`--work`, `--budget`), then with one run's config made invalid.
"""

from __future__ import annotations

import json
import re
import sys
import tarfile

import pytest

from helpers.checklist import (
    CPU_CHECKS,
    ENV,
    FIVE,
    FP16,
    GPU_SKIPPED,
    LEFT,
    MB,
    MORE,
    PLANNER,
    RUNS_1B,
    SCRIPT,
    ST,
    results,
    slug,
)
from helpers.launch import run

# ---------------------------------------------------------------------------- the list


@pytest.mark.unit
def test_the_list_runs_in_the_issues_order(checklist):
    on_gpu = [c.name for c in checklist.CHECKS if "no-cuda" not in c.needs]
    assert on_gpu == [
        *ENV, *(f"{e}-bf16" for e in FIVE), *MB, *RUNS_1B, *PLANNER, *MORE, *LEFT, *FP16,
    ]  # fmt: skip
    on_cpu = [c.name for c in checklist.CHECKS if "cuda" not in c.needs]
    assert on_cpu == ["nvidia-smi", *CPU_CHECKS]
    parts = {}
    for c in checklist.CHECKS:
        parts.setdefault(c.part, []).append(c.name)
    assert parts == {
        1: list(ENV),
        2: [*(f"{e}-bf16" for e in FIVE), "ddp-cpu", "fsdp-cpu", "zero2-cpu"],
        3: [*MB, *RUNS_1B],
        4: [*PLANNER, "tiny-ddp-cpu", "tiny-zero2-cpu"],
        5: list(MORE),
        6: [*LEFT, *FP16],
    }
    assert [c.part for c in checklist.CHECKS] == sorted(c.part for c in checklist.CHECKS)
    assert checklist.CHECKS[-21:-11] == checklist.MORE_CHECKS and {c.part for c in checklist.MORE_CHECKS} == {5}
    checks = {c.name: c for c in checklist.CHECKS}
    assert len(checks) == len(checklist.CHECKS), "check names are unique"
    # Every check has an expected time: GPU mode's table holds exactly the checks GPU mode runs, CPU_S the CPU mode's.
    assert set(checklist.times.GPU_S) == set(on_gpu) and set(checklist.times.CPU_S) == set(on_cpu)
    # Training runs and their steps: 3 on GPU (ENGINE_STEPS), 10 for fp16 and the CPU stand-ins, 20 for the 1b runs.
    assert {n: c.steps for n, c in checks.items() if c.steps} == {
        **{f"{e}-bf16": 3 for e in (*FIVE, "zero1", "fsdp-offload")},
        **dict.fromkeys(("ddp-cpu", "fsdp-cpu", "zero2-cpu"), 10),
        **dict.fromkeys((*RUNS_1B, "1b-eager-mb{mb}-AC"), 20),
        "moe-small-bf16": 4, "document-mask-bf16": 3, "oom-1b-mb64": 3, "moe-v3-grouped-bf16": 10, "moe-v3-loop-bf16": 10,
        "long-1b-32k-AC": 10, "long-1b-32k-AC-host-tiles": 10, **dict.fromkeys(FP16, 10),
    }  # fmt: skip
    assert {n for n, c in checks.items() if c.retry_oom} == {*RUNS_1B, "1b-eager-mb{mb}-AC"}
    assert {c.judge for c in checklist.CHECKS} == set(checklist.JUDGES)  # every judge used, none missing
    for c in checklist.CHECKS:
        assert c.judge in checklist.JUDGES and c.part in range(1, 7), c
        # CUDA-only: what runs on the device, uses the DeepSpeed optimizer found for it, or plans for it.
        on_cuda = "run.device=cuda" in c.argv or checklist.DS in c.argv or "--configured-only" in c.argv
        on_cuda |= c.judge in ("ds_optimizer", "micro_batch") or any(w.endswith("cp_kernels.py") for w in c.argv)
        on_cuda |= c.judge in ("calibrate", "clock_gpu")  # the clock's table of this GPU, and its use
        assert ("cuda" in c.needs) == on_cuda, c.name
        assert ("no-cuda" in c.needs) == ("run.device=cpu" in c.argv), c.name  # the CPU stand-ins
        assert (c.steps > 0) == (c.judge in ("trains", "host_syncs", "mfu")), c.name
        assert (c.judge == "measure") == ("--measure" in c.argv), c.name
    offload = {c.name: c.argv for c in checklist.CHECKS if "offload" in c.name}
    assert list(offload) == ["zero3-offload-bf16", "fsdp-offload-bf16", "zero3-offload-fp16"]
    assert all("parallel.offload_params=cpu" in argv for argv in offload.values())
    # The mixture of experts counts its host reads: two intervals of 2 steps (the later log_every wins).
    moe = checks["moe-small-bf16"]
    assert moe.judge == "host_syncs" and moe.argv.index("train.log_every=2") > moe.argv.index("train.log_every=1")
    assert "telemetry.host_syncs=true" in moe.argv and "model.moe={{}}" in moe.argv


@pytest.mark.unit
def test_list_prints_every_command_its_expected_time_and_where_the_budget_cuts(checklist, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(checklist.launch, "Launched", lambda *a, **k: pytest.fail(f"--list ran {a}"))
    assert checklist.main([str(tmp_path / "out"), "--list"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    assert out.startswith(
        "Expected seconds: H200, 2026-11-27 for GPU mode (scripts/gpu_checklist_times.py, plus 0.5 s of the checklist's own per "
        "check); where --budget 540 cuts, with 5 s kept for the end\n"
    )
    assert out.count("\n       $ ") == sum(1 for c in checklist.CHECKS if c.argv)
    assert out.count("\n       (no command)\n") == 2  # the DeepSpeed optimizer and the micro-batch: judged from earlier checks
    times = checklist.times
    total = used = 0.0
    cut, skipped = None, []
    for c in checklist.CHECKS:
        line = re.search(rf"^\[{c.part}\] {re.escape(c.name)}.*; judge: {c.judge}; (.*)$", out, re.MULTILINE)
        assert line, c.name
        if "no-cuda" in c.needs:
            assert line[1] == f"~{times.CPU_S[c.name] + times.OVERHEAD_S:.0f} s, measured, CPU, CPU mode only"
            continue
        s = times.GPU_S[c.name] + times.OVERHEAD_S
        total += s
        label = "estimate" if c.name in times.ESTIMATED else "measured"  # what the H200 run timed (times.SOURCE)
        assert line[1].startswith(f"~{s:.0f} s, {label}, {total:.0f} s in all"), line[0]
        fits = used + s <= 540 - times.RESERVE_S  # the budget skips what does not fit and goes on
        used += s if fits else 0
        if not fits:
            cut = cut or c.name
            skipped.append(c.name)
        assert ("skipped under --budget 540" in line[1]) == (not fits), line[0]
    # With the H200's times, the 540 s of the lent machine hold parts 1-3 and most of part 4; a shorter check
    # after the cut still runs (small-zero2-bf16), and part 5's out-of-memory check and part 6 wait.
    assert cut == "1b-zero3-bf16-AC-mb4" and out.count("------ a 540 s budget (--budget 540) cuts here") == 1
    assert "small-zero2-bf16" not in skipped and {"oom-1b-mb64", "zero1-bf16"} <= set(skipped)
    assert out.index("cuts here") < out.index("[4] 1b-zero3-bf16-AC-mb4") and out.index("cuts here") > out.index(
        "[4] 1b-fsdp-bf16-mb2"
    )
    assert out.rstrip().endswith(f"GPU mode: {total:.0f} s expected for every check; {used:.0f} s of them run under --budget 540")
    runs = tmp_path / "out" / "runs"
    for exact in (  # as they run: the fixed tail of a training run, and the templates filled at run time
        "[1] DeepSpeed optimizer (needs cuda): FusedAdam where nvcc can build it, else WARN and torch's AdamW "
        "(DS_OPTIMIZER); judge: ds_optimizer; ~0 s, measured, 13 s in all\n       (no command)",
        "[2] zero2-cpu (needs no-cuda): zero2 trains on CPU (stand-in); judge: trains; ~6 s, measured, CPU, CPU mode only\n"
        f"       $ {ST} train model.preset=tiny run.device=cpu precision=fp32 train.log_every=5 parallel.strategy=zero2 "
        f"parallel.bucket_size=2000000 train.steps=10 checkpoint.every=0 train.resume=never run.dir={runs}/zero2-cpu",
        f"       $ {ST} train model.preset=small run.device=cuda train.log_every=1 parallel.strategy=zero2 '{{ds_extra}}' "
        f"precision=bf16 train.steps=3 checkpoint.every=0 train.resume=never run.dir={runs}/zero2-bf16",
        f"       $ {ST} plan model.preset=1b model.vocab_size=128256 data.seq_len=2048 precision=bf16 parallel.strategy=fsdp "
        "parallel.activation_checkpointing=true train.micro_batch=1 --gpus-per-node 1 --gpu '{gpu_kind}' "
        "--gpu-memory '{gpu_memory}B' --configured-only --json",
        f"       $ {ST} train model.preset=1b model.vocab_size=128256 data.seq_len=2048 precision=bf16 run.device=cuda "
        "parallel.strategy=fsdp 'train.micro_batch={mb}' train.log_every=5 'telemetry.profile_steps=[5,5]' "
        "'parallel.activation_checkpointing={ac}' "
        "train.compile=true train.float8=true train.steps=20 checkpoint.every=0 train.resume=never "
        f"'run.dir={runs}/1b-float8-compiled-mb{{mb}}{{ac_tag}}'",
        "[5] moe-small-bf16 (needs cuda): a mixture of experts trains in bf16 on CUDA (the grouped matmul), no host sync "
        "in a step; judge: host_syncs; ~12 s, measured, 678 s in all\n"
        f"       $ {ST} train model.preset=small run.device=cuda train.log_every=1 'model.moe={{}}' parallel.strategy=fsdp "
        "precision=bf16 telemetry.host_syncs=true train.log_every=2 train.steps=4 checkpoint.every=0 train.resume=never "
        f"run.dir={runs}/moe-small-bf16",
        f"       $ {sys.executable} {SCRIPT.parent / 'cp_kernels.py'}",
        "[6] fsdp-offload-bf16 (needs cuda): fsdp-offload trains in bf16 on CUDA; judge: trains; ~8 s, measured, 1050 s "
        "in all: skipped under --budget 540\n"
        f"       $ {ST} train model.preset=small run.device=cuda train.log_every=1 parallel.strategy=fsdp "
        f"parallel.offload_params=cpu precision=bf16 train.steps=3 checkpoint.every=0 train.resume=never "
        f"run.dir={runs}/fsdp-offload-bf16",
        f"       $ {ST} plan model.preset=small data.seq_len=256 train.micro_batch=8 run.device=cuda parallel.strategy=zero3 "
        "precision=bf16 '{ds_extra}' --measure --json",
        f"       $ {ST} train model.preset=small run.device=cuda train.log_every=1 parallel.strategy=zero3 "
        "parallel.offload_optimizer=cpu parallel.offload_params=cpu precision=fp16 train.steps=10 checkpoint.every=0 "
        f"train.resume=never run.dir={runs}/zero3-offload-fp16",
    ):
        assert f"{exact}\n" in out, exact

    # Another budget cuts elsewhere, once.
    assert checklist.main(["--list", "--budget", "60"]) == 0
    out = capsys.readouterr().out
    assert out.count("cuts here") == 1 and "a 60 s budget (--budget 60) cuts here" in out
    assert "where --budget 60 cuts" in out.splitlines()[0]

    # A table of round numbers, a measured source, --work and --set: a check after the cut that still fits is not
    # marked (the budget skips, it does not stop), and --set goes after the other overrides, the runs into --work.
    table = {n: 19.5 for n in checklist.times.GPU_S} | {"nvidia-smi": 4.5, "DeepSpeed optimizer": 0, "MFU 1b": 0}
    monkeypatch.setattr(checklist.times, "GPU_S", table)
    monkeypatch.setattr(checklist.times, "SOURCE", "H100 80GB, 2026-12-01")
    work = tmp_path / "work"
    argv = [str(tmp_path / "o"), "--list", "--budget", "60", "--work", str(work), "--set", "data.dir=/scratch"]
    assert checklist.main(argv) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "o").exists() and not work.exists()
    assert out.startswith("Expected seconds: H100 80GB, 2026-12-01 for GPU mode (")
    lines = [ln for ln in out.splitlines() if ln.startswith(("[1]", "[2] ddp-bf16", "[2] fsdp-bf16", "[3] MFU", "---"))]
    assert lines == [
        "[1] nvidia-smi: the GPUs the driver sees (SKIP without nvidia-smi); judge: nvidia_smi; ~5 s, measured, 5 s in all",
        "[1] scaletrain CLI: the CLI starts; judge: first_line; ~20 s, measured, 25 s in all",
        "[1] python/torch/deepspeed: versions and the device; FAIL where nvidia-smi lists a GPU torch cannot use; "
        "judge: env; ~20 s, measured, 45 s in all",
        "[1] DeepSpeed optimizer (needs cuda): FusedAdam where nvcc can build it, else WARN and torch's AdamW "
        "(DS_OPTIMIZER); judge: ds_optimizer; ~0 s, measured, 46 s in all",  # 45.5
        "------ a 60 s budget (--budget 60) cuts here: a check that no longer fits is skipped, a later one that fits still runs",
        "[2] ddp-bf16 (needs cuda): ddp trains in bf16 on CUDA; judge: trains; ~20 s, measured, 66 s in all: "
        "skipped under --budget 60",
        "[2] fsdp-bf16 (needs cuda): fsdp trains in bf16 on CUDA; judge: trains; ~20 s, measured, 86 s in all: "
        "skipped under --budget 60",
        "[3] MFU 1b (needs cuda, planned): the runs' micro-batch: the largest power of two within the plan and "
        "MFU_MAX_MB; activation checkpointing (a recompute of each block) only where nothing fits without; "
        "judge: micro_batch; ~0 s, measured, 186 s in all",  # 45.5 + 0.5 = 46 of 55 fit: not skipped
    ]
    assert out.rstrip().endswith("GPU mode: 746 s expected for every check; 46 s of them run under --budget 60")
    assert (
        f"       $ {ST} train model.preset=small run.device=cuda train.log_every=1 parallel.strategy=fsdp precision=bf16 "
        f"train.steps=3 checkpoint.every=0 train.resume=never run.dir={work}/runs/fsdp-bf16 data.dir=/scratch\n"
    ) in out
    assert (
        f"       $ {ST} plan model.preset=tiny run.device=cpu precision=fp32 parallel.strategy=ddp data.dir=/scratch "
        "--measure --json\n"
    ) in out


# ---------------------------------------------------------------------------- CPU mode, for real


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_cpu_mode_end_to_end_then_a_planted_failure(small_dataset, tmp_path):
    """The CPU mode as the lent machine runs it (--work, --budget 540), on the session's small corpus: every
    check passes and OUT_DIR holds four files; then one run's config is made invalid (train.lr=-1), and
    that check fails with its command and the end of its log, and the exit is 1."""
    checklist = [sys.executable, str(SCRIPT)]
    data = f"data.paths={small_dataset}"  # not the stdlib corpus: no tokenizing, nothing in the repository's data/
    env = {"FORCE_CPU": "1", "ENGINE_STEPS": "6"}  # the CPU mode wherever this runs; short engine runs
    ok, work = tmp_path / "ok", tmp_path / "work"
    proc = run([*checklist, str(ok), "--work", str(work), "--budget", "540", "--set", data], env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith(f"gpu_checklist: results in {ok}, logs and runs in {work}\n")
    got = results(ok)
    assert {n: r["status"] for n, r in got.items() if n != "nvidia-smi"} == {
        **dict.fromkeys(CPU_CHECKS, "PASS"),
        GPU_SKIPPED: "SKIP",
    }
    assert list(got)[1:] == [*CPU_CHECKS, GPU_SKIPPED] and list(got)[0] == "nvidia-smi"
    assert "\nSKIP [4] GPU parts (engines and planner on CUDA, 1b MFU): GPU parts skipped: no CUDA device\n" in proc.stdout
    assert re.search(rf"^summary: {re.escape(str(ok))}/summary\.md \(CPU mode, \d+ s, 0 failed\)$", proc.stdout, re.M)
    assert proc.stdout.rstrip().endswith("PASS: every check passed")
    first = {e: got[f"{e}-cpu"]["data"] for e in ("ddp", "fsdp", "zero2")}
    assert all(d["steps"] == 6 and d["engine"] == e and d["last_loss"] < d["first_loss"] for e, d in first.items())
    assert len({(d["first_loss"], d["last_loss"]) for d in first.values()}) == 1  # the engines agree to the printed digits too
    assert got["ddp-cpu"]["cmd"] == (
        f"{sys.executable} -m scaletrain train model.preset=tiny run.device=cpu precision=fp32 train.log_every=5 "
        f"parallel.strategy=ddp train.steps=6 checkpoint.every=0 train.resume=never run.dir={work}/runs/ddp-cpu {data}"
    )
    assert got["tiny-zero2-cpu"]["cmd"] == (
        f"{sys.executable} -m scaletrain plan model.preset=tiny run.device=cpu precision=fp32 parallel.strategy=zero2 "
        f"{data} --measure --json"
    )
    assert got["tiny-zero2-cpu"]["data"]["strategy"] == "zero2" and got["tiny-zero2-cpu"]["data"]["measured"] > 0
    assert all(got[n]["seconds"] > 0 for n in CPU_CHECKS)
    # OUT_DIR: four files (what the device tool brings back); the logs and runs in --work, without checkpoints.
    assert sorted(p.name for p in ok.iterdir()) == ["env.json", "logs.tar.gz", "results.jsonl", "summary.md"]
    assert json.loads((ok / "env.json").read_text())["cuda_available"] is False
    assert not list((work / "runs").glob("*/checkpoints")) and (work / "logs" / "zero2-cpu.log").exists()
    with tarfile.open(ok / "logs.tar.gz") as tar:
        names = set(tar.getnames())
        assert names == {
            *(f"logs/{slug(n)}.log" for n in CPU_CHECKS),
            *(f"runs/{e}-cpu/{f}" for e in ("ddp", "fsdp", "zero2") for f in ("config.yaml", "metrics.jsonl", "run.json")),
        } | ({"logs/nvidia-smi.log"} if got["nvidia-smi"]["cmd"] else set())
        assert tar.extractfile("runs/fsdp-cpu/metrics.jsonl").read() == (work / "runs/fsdp-cpu/metrics.jsonl").read_bytes()
        assert tar.extractfile("logs/scaletrain-CLI.log").read().decode().startswith("scaletrain 0.1")
    summary = (ok / "summary.md").read_text()
    assert summary.startswith("# scaletrain GPU checklist: CPU (CPU mode)") and "so far" not in summary
    assert "| 2 | zero2-cpu | PASS |" in summary and "| ddp-cpu | ddp | none (one process, no DDP wrapper) |" in summary
    assert "| fsdp-cpu | fsdp | gloo (group of one) |" in summary and "| tiny-ddp-cpu | ddp |" in summary
    assert "## MFU" not in summary and f"- ddp-cpu: `{got['ddp-cpu']['cmd']}`" in summary

    bad, bad_work = tmp_path / "bad", tmp_path / "bad-work"
    argv = [str(bad), "--work", str(bad_work), "--budget", "540", "--only", "ddp-cpu", "--set", data, "--set", "train.lr=-1"]
    proc = run([*checklist, *argv], env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    line = re.search(r"^FAIL \[2\] ddp-cpu: exit 2, log (.*) \(\d+ s\)\n {7}\$ (.*)$", proc.stdout, re.MULTILINE)
    assert line and line[1] == f"{bad_work}/logs/ddp-cpu.log", proc.stdout[-4000:]
    assert line[2].endswith(f"run.dir={bad_work}/runs/ddp-cpu {data} train.lr=-1"), line[2]
    assert re.search(r"^ {7}\| scaletrain: error: .*train\.lr", proc.stdout, re.MULTILINE)  # the end of its log, under it
    assert proc.stdout.rstrip().endswith("FAIL: 1 check(s) failed")
    assert {n: r["status"] for n, r in results(bad).items() if n != "nvidia-smi"} == {
        **dict.fromkeys(CPU_CHECKS[:2], "PASS"), "ddp-cpu": "FAIL", GPU_SKIPPED: "SKIP"}  # fmt: skip
    assert "| 2 | ddp-cpu | FAIL | exit 2" in (bad / "summary.md").read_text()
    with tarfile.open(bad / "logs.tar.gz") as tar:
        assert "scaletrain: error:" in tar.extractfile("logs/ddp-cpu.log").read().decode()
