"""scripts/gpu_checklist.py: its list of checks, its GPU mode against faked processes, its CPU mode for real.

The GPU parts need a GPU this machine lacks, so: the declarative list is checked against what the bash
checklist ran (every engine x precision, each CUDA-only check marked so); `--list` prints every exact
command and runs nothing; GPU mode runs in-process with every process faked (what the driver makes of
what the runs report: the DeepSpeed optimizer fallback, the planned micro-batch, the out-of-memory
retry, the MFU tables); and the CPU mode runs end to end as a user runs it, then with one run's config
made invalid.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_checklist.py"
KNOBS = ("STEP_TIMEOUT", "ENGINE_STEPS", "MFU_STEPS", "MFU_MAX_MB", "DS_OPTIMIZER", "KEEP_CHECKPOINTS", "FORCE_CPU")
# Part 2 of the bash checklist: these 7 engine configurations, each in bf16 and fp16, on CUDA.
ENGINES = ("ddp", "fsdp", "zero1", "zero2", "zero3", "zero3-offload", "fsdp-offload")
CPU_CHECKS = ("scaletrain CLI", "python/torch/deepspeed", "ddp-cpu", "fsdp-cpu", "zero2-cpu", "tiny-ddp-cpu", "tiny-zero2-cpu")
GPU_SKIPPED = "GPU parts (engines and planner on CUDA, 1b MFU)"


@pytest.fixture
def checklist(monkeypatch):
    """The script as a module, its knobs at their defaults."""
    for knob in KNOBS:
        monkeypatch.delenv(knob, raising=False)
    spec = importlib.util.spec_from_file_location("gpu_checklist", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_checklist", module)  # where dataclasses look for the module's names
    spec.loader.exec_module(module)
    return module


def results(out: Path) -> dict[str, dict]:
    return {r["name"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


@pytest.mark.unit
def test_the_list_is_well_formed(checklist):
    checks = {c.name: c for c in checklist.CHECKS}
    assert len(checks) == len(checklist.CHECKS), "check names are unique"
    for engine in ENGINES:
        for precision in ("bf16", "fp16"):
            c = checks.pop(f"{engine}-{precision}")
            assert c.part == 2 and c.steps == 20 and {f"precision={precision}", "run.device=cuda"} <= set(c.argv)
    # Everything else the bash checklist reported on.
    assert set(checks) == {
        *("nvidia-smi", "DeepSpeed optimizer", *CPU_CHECKS),
        *("small-ddp-fp32", "small-fsdp-bf16", "small-zero2-bf16", "small-zero3-bf16"),
        *("1b-fsdp-bf16-AC-mb4", "1b-fsdp-bf16-mb2", "1b-zero3-bf16-AC-mb4"),
        *("moe-small-bf16", "oom-1b-mb64"),  # a mixture of experts (issue 27), a real out-of-memory error (issue 26)
        "document-mask-bf16",  # FlexAttention's block mask (issue 28)
        "cp-attention-kernels",  # context parallel's chunk attention on flash and cuDNN (issue 29)
        *(
            "plan 1b AC=false",
            "plan 1b AC=true",
            "MFU 1b",
            "1b-eager-mb{mb}{ac_tag}",
            "1b-compiled-mb{mb}{ac_tag}",
            "1b-eager-mb{mb}-AC",
        ),
    }
    for c in checklist.CHECKS:
        assert c.judge in checklist.JUDGES and c.part in (1, 2, 3, 4), c
        # CUDA-only: whatever runs on the device, uses the DeepSpeed optimizer found for it, or is part 4.
        on_cuda = "run.device=cuda" in c.argv or checklist.DS in c.argv or c.judge == "ds_optimizer" or c.part == 4
        on_cuda |= any(str(w).endswith("cp_kernels.py") for w in c.argv)  # a script of CUDA kernels alone
        assert ("cuda" in c.needs) == on_cuda, c.name
        assert ("no-cuda" in c.needs) == ("run.device=cpu" in c.argv), c.name  # the CPU stand-ins
        assert (c.steps > 0) == (c.judge == "trains") and (c.judge == "measure") == ("--measure" in c.argv), c.name
    offload = {c.name: c.argv for c in checklist.CHECKS if "offload" in c.name}
    assert all("parallel.offload_params=cpu" in argv for argv in offload.values()) and len(offload) == 4


@pytest.mark.unit
def test_list_prints_every_command_and_runs_nothing(checklist, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(checklist.helpers, "Launched", lambda *a, **k: pytest.fail(f"--list ran {a}"))
    assert checklist.main([str(tmp_path / "out"), "--list"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    for c in checklist.CHECKS:
        assert f"[{c.part}] {c.name}" in out
    assert out.count("\n       $ ") == sum(1 for c in checklist.CHECKS if c.argv)
    st, runs = f"{sys.executable} -m scaletrain", tmp_path / "out" / "runs"
    for exact in (  # as they run: the fixed tail of a training run, and the templates filled at run time
        f"{st} train model.preset=tiny run.device=cpu precision=fp32 train.log_every=5 parallel.strategy=zero2 "
        f"parallel.bucket_size=2000000 train.steps=10 checkpoint.every=0 train.resume=never run.dir={runs}/zero2-cpu",
        f"{st} train model.preset=small run.device=cuda train.log_every=5 parallel.strategy=fsdp parallel.offload_params=cpu "
        f"precision=fp16 train.steps=20 checkpoint.every=0 train.resume=never run.dir={runs}/fsdp-offload-fp16",
        f"{st} plan model.preset=small data.seq_len=256 train.micro_batch=8 run.device=cuda parallel.strategy=zero3 "
        "precision=bf16 '{ds_extra}' --measure --json",
        f"{st} plan model.preset=tiny run.device=cpu precision=fp32 parallel.strategy=ddp --measure --json",
    ):
        assert f"       $ {exact}\n" in out


def fake_run_dir(run_dir: Path, steps: int, engine: str) -> None:
    """What a run writes that the checklist reads: step rows, two log intervals, run.json."""
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "loss": 11.8 - 0.1 * s} for s in range(1, steps + 1)]
    rows += [{"event": "interval", "tokens_per_s": 40000.0, "mfu": 0.42, "step_s": 0.4, "mem_peak_bytes": 60 * 2**30,
              "phases": {"forward_s": 0.1, "backward_s": 0.25, "optimizer_s": 0.05}}] * 2  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "run.json").write_text(
        json.dumps({"engine": engine, "device": "cuda", "peak_flops": 989e12, "peak_flops_source": "table"})
    )


@pytest.mark.unit
def test_gpu_mode_with_faked_processes(checklist, monkeypatch, tmp_path):
    """An H100 without nvcc, as the processes report it; the 1b eager run at micro-batch 8 runs out of memory."""
    h100 = {"python": "3.11.7", "torch": "2.13.0", "torch_cuda": "12.8", "deepspeed": "0.19.8", "scaletrain": "0.1.0",
            "host": "gpu", "cuda_available": True, "device_count": 1, "device_name": "NVIDIA H100 80GB HBM3",
            "capability": "9.0", "device_memory": 85_029_158_912, "bf16": True, "nccl": "2.27.3"}  # fmt: skip
    commands = []

    class FakeProcess:  # helpers.Launched, its wait() answering as the real process would
        def __init__(self, argv):
            self.wait = lambda timeout: fake_run(argv)

    def fake_run(argv):
        commands.append(argv)
        o = dict(w.split("=", 1) for w in argv if "=" in w and not w.startswith("-"))
        done = lambda stdout="", rc=0, stderr="": subprocess.CompletedProcess(argv, rc, stdout, stderr)  # noqa: E731
        if argv[0] == "nvidia-smi":
            return done("NVIDIA H100 80GB HBM3, 570.86, 81559 MiB, 9.0\n")
        if "--version" in argv:
            return done("scaletrain 0.1.0\n")
        if "--env-json" in argv:
            return done(json.dumps(h100))
        if argv[1].endswith("cp_kernels.py"):  # one JSON line per backend and cp
            return done('{"backend": "FLASH_ATTENTION", "cp": 2, "max_abs_diff": 0.0039, "atol": 0.02, "ok": true}\n')
        if "--configured-only" in argv:  # the planner for this device: 9 fit without activation checkpointing, 18 with
            mb = 18 if o["parallel.activation_checkpointing"] == "true" else 9
            plan = {
                "chosen": "fsdp",
                "max_micro_batch": mb,
                "candidates": [{"strategy": "fsdp", "fits": True, "memory": {"peak": 2**34}}],
            }
            return done(json.dumps(plan))
        if "--measure" in argv:
            measured = {"peak": 1.9e9, "cuda_max_allocated": 1.6e9}
            return done(
                json.dumps({"strategy": o["parallel.strategy"], "world": 1, "predicted": {"peak": 2e9}, "measured": measured})
            )
        if (
            o.get("train.micro_batch") == "8"
            and o["train.compile"] == "false"
            and o["parallel.activation_checkpointing"] == "false"
        ):
            return done(rc=1, stderr="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
        fake_run_dir(Path(o["run.dir"]), int(o["train.steps"]), o["parallel.strategy"])
        return done("training finished\n")

    monkeypatch.chdir(tmp_path)  # main changes into the repository; this changes back afterwards
    monkeypatch.setattr(checklist.shutil, "which", lambda program: program)  # nvidia-smi "is there"
    monkeypatch.setattr(checklist.helpers, "Launched", lambda argv, one_thread: FakeProcess(argv))
    out = tmp_path / "out"
    assert checklist.main([str(out)]) == 1  # the out-of-memory attempt counts as a failure
    got = results(out)
    assert {n for n, r in got.items() if r["status"] == "FAIL"} == {"1b-eager-mb8"}
    assert got["DeepSpeed optimizer"]["status"] == "WARN" and not {*CPU_CHECKS[2:], GPU_SKIPPED} & set(got)
    for engine in ENGINES:
        for precision in ("bf16", "fp16"):
            r = got[f"{engine}-{precision}"]
            assert r["status"] == "PASS" and r["data"]["steps"] == 20
            # No nvcc: torch's AdamW for ZeRO without offload, and for nothing else.
            assert (checklist.TORCH_ADAM in r["cmd"]) == (engine in ("zero1", "zero2", "zero3")), r["cmd"]
    assert "--gpu h100 --gpu-memory 85029158912B" in got["plan 1b AC=false"]["cmd"]
    assert got["MFU 1b"]["detail"].startswith("micro-batch 8 x 2048 tokens, activation checkpointing false")
    assert [n for n in got if n.startswith("1b-") and "bf16" not in n] == [
        "1b-eager-mb8",
        "1b-eager-mb4",
        "1b-compiled-mb8",
        "1b-eager-mb8-AC",
    ]
    assert "train.micro_batch=4 " in got["1b-eager-mb4"]["cmd"] and "train.compile=true" in got["1b-compiled-mb8"]["cmd"]
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# scaletrain GPU checklist: NVIDIA H100 80GB HBM3 (GPU mode)")
    assert "| small-zero3-bf16 | zero3 | 1.86 GiB | 1.77 GiB | +5.3% | 1.49 GiB | +25.0% |" in summary
    assert "| 1b-compiled-mb8 | 40,000 | 42.0% | 400.0 | 60.00 GiB | 989 TFLOP/s (table) | PASS |" in summary
    assert "| 1b-eager-mb8-AC | - | 100.0 (25%) | 250.0 (62%) | 50.0 (12%) | - | - | 400.0 |" in summary
    assert got["moe-small-bf16"]["status"] == got["oom-1b-mb64"]["status"] == "PASS"
    assert "model.moe={}" in got["moe-small-bf16"]["cmd"] and "train.micro_batch=64" in got["oom-1b-mb64"]["cmd"]
    assert got["document-mask-bf16"]["status"] == "PASS" and "data.document_mask=true" in got["document-mask-bf16"]["cmd"]
    assert got["cp-attention-kernels"]["status"] == "PASS" and "FLASH_ATTENTION" in got["cp-attention-kernels"]["detail"]
    assert sum(1 for argv in commands if "train" in argv) == 14 + 3 + 4


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_cpu_mode_end_to_end_then_a_planted_failure(small_dataset, tmp_path):
    """The CPU mode as a user runs it, on the session's small corpus: every check passes; then one
    run's config is made invalid (train.lr=-1), and that check fails with its command and the exit is 1."""
    checklist = [sys.executable, str(SCRIPT)]
    data = f"data.paths={small_dataset}"  # not the stdlib corpus: no tokenizing, nothing in the repository's data/
    env = {"FORCE_CPU": "1", "ENGINE_STEPS": "6"}  # the CPU mode wherever this runs; short engine runs
    ok = tmp_path / "ok"
    proc = run([*checklist, str(ok), "--set", data], env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    got = results(ok)
    assert {n: r["status"] for n, r in got.items() if n != "nvidia-smi"} == {
        **dict.fromkeys(CPU_CHECKS, "PASS"),
        GPU_SKIPPED: "SKIP",
    }
    assert "SKIP [4] GPU parts (engines and planner on CUDA, 1b MFU): GPU parts skipped: no CUDA device" in proc.stdout
    assert proc.stdout.rstrip().endswith("PASS: every check passed")
    first = {e: got[f"{e}-cpu"]["data"] for e in ("ddp", "fsdp", "zero2")}
    assert all(d["steps"] == 6 and d["engine"] == e and d["last_loss"] < d["first_loss"] for e, d in first.items())
    assert len({(d["first_loss"], d["last_loss"]) for d in first.values()}) == 1  # the engines agree to the printed digits too
    assert got["ddp-cpu"]["cmd"].endswith(f"train.steps=6 checkpoint.every=0 train.resume=never run.dir={ok}/runs/ddp-cpu {data}")
    assert got["tiny-zero2-cpu"]["data"]["strategy"] == "zero2" and got["tiny-zero2-cpu"]["data"]["measured"] > 0
    assert not list((ok / "runs").glob("*/checkpoints")) and (ok / "logs" / "zero2-cpu.log").exists()
    summary = (ok / "summary.md").read_text()
    assert summary.startswith("# scaletrain GPU checklist: CPU (CPU mode)")
    assert "| 2 | zero2-cpu | PASS |" in summary and "| ddp-cpu | ddp | none (one process, no DDP wrapper) |" in summary
    assert "| fsdp-cpu | fsdp | gloo (group of one) |" in summary and "| tiny-ddp-cpu | ddp |" in summary
    assert "## MFU" not in summary and f"- ddp-cpu: `{got['ddp-cpu']['cmd']}`" in summary

    bad = tmp_path / "bad"
    proc = run([*checklist, str(bad), "--only", "ddp-cpu", "--set", data, "--set", "train.lr=-1"], env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    line = re.search(r"^FAIL \[2\] ddp-cpu: exit 2, log .*\n {7}\$ (.*)$", proc.stdout, re.MULTILINE)
    assert line and line[1].endswith("train.lr=-1"), proc.stdout[-4000:]
    assert re.search(r"^ {7}\| scaletrain: error: .*train\.lr", proc.stdout, re.MULTILINE)  # the end of its log, under it
    assert proc.stdout.rstrip().endswith("FAIL: 1 check(s) failed")
    assert {n: r["status"] for n, r in results(bad).items() if n != "nvidia-smi"} == {
        **dict.fromkeys(CPU_CHECKS[:2], "PASS"), "ddp-cpu": "FAIL", GPU_SKIPPED: "SKIP"}  # fmt: skip
    assert "| 2 | ddp-cpu | FAIL | exit 2" in (bad / "summary.md").read_text()
