"""scripts/gpu_checklist.py's GPU mode, run in-process with every process faked and a faked clock:
what the driver makes of what the runs report (the DeepSpeed optimizer fallback, the planned
micro-batch, the out-of-memory retry, the host reads of a step, the MFU tables); which checks a
budget skips and the timeout each command gets; results.jsonl, summary.md and logs.tar.gz on disk
before each next command starts. (The list and CPU mode: test_gpu_checklist.py.)
"""

from __future__ import annotations

import io
import json
import re
import shlex
import subprocess
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.checklist import (
    CLEAN,
    CPU_CHECKS,
    ENV,
    FIVE,
    FP16,
    GPU_SKIPPED,
    H100,
    LEFT,
    MB,
    MORE,
    PLANNER,
    RUNS_1B,
    ST,
    filled,
    results,
    slug,
)

# ---------------------------------------------------------------------------- GPU mode, every process faked


def fake_run_dir(run_dir: Path, steps: int, engine: str, fp16: bool, host_syncs, loss, profiled=False) -> None:
    """What a run writes that the checklist reads: step rows, two log intervals (each with its host reads,
    where `host_syncs` gives them), run.json, config.yaml; `profiled`: a trace of step 5 as on CUDA
    (0.5 ms: 300 us of two GEMMs, 100 us of FlashAttention, 100 us with nothing on the device)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if profiled:
        x = lambda name, ts, dur, cat="kernel": {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 7, "ts": ts, "dur": dur}
        events = [x("ProfilerStep#5", 0, 500, "user_annotation"), x("nvjet_hsh_256x128", 0, 200),
                  x("sm90_xmma_gemm_bf16", 200, 100), x("pytorch_flash::flash_fwd_kernel", 400, 100)]  # fmt: skip
        (run_dir / "profile").mkdir()
        (run_dir / "profile" / "rank0.trace.json").write_text(json.dumps({"traceEvents": events}))
    rows = [{"step": s, "loss": loss(s), **({"skipped": s == 1} if fp16 else {})} for s in range(1, steps + 1)]
    for counted in host_syncs:
        rows.append({"event": "interval", "steps": 2, "tokens_per_s": 40000.0, "mfu": 0.42, "step_s": 0.4,
                     "mem_peak_bytes": 60 * 2**30, "phases": {"forward_s": 0.1, "backward_s": 0.25, "optimizer_s": 0.05},
                     **({} if counted is None else {"host_syncs": counted})})  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = {"engine": engine, "device": "cuda", "peak_flops": 989e12, "peak_flops_source": "table"}
    (run_dir / "run.json").write_text(json.dumps(info))
    (run_dir / "config.yaml").write_text(f"parallel:\n  strategy: {engine}\n")


@pytest.fixture
def fake_gpu(checklist, monkeypatch, tmp_path):
    """GPU mode in-process: an H100 without nvcc as every process reports it, and a faked clock that only
    the processes move. Returns (commands, hooks): commands, each (argv, timeout) as started; hooks, which
    a test sets: "before" (argv), called as a process starts; "takes" (argv) -> its seconds (past its
    timeout: killed there, as the helpers do); "oom" (overrides) -> whether it runs out of memory;
    "host_syncs" (overrides) -> each interval row's host reads (None: the field left out); "loss" (step) -> its loss."""
    commands, hooks, clock = [], {}, [1000.0]

    class FakeProcess:  # helpers.launch.Launched: wait() answers as the real process would, _read what it wrote so far
        _read = staticmethod(lambda f: f.getvalue())

        def __init__(self, argv, one_thread):
            assert one_thread is False
            self.argv, self._out, self._err = argv, io.StringIO(), io.StringIO()

        def wait(self, timeout):
            commands.append((self.argv, timeout))
            hooks.get("before", lambda argv: None)(self.argv)
            takes = hooks.get("takes", lambda argv: 0)(self.argv)
            if takes > timeout:  # the helpers kill the tree and raise
                clock[0] += timeout
                self._out.write("step 1 ...\n")
                raise AssertionError(f"timed out after {timeout:.0f} s: {' '.join(self.argv)}")
            clock[0] += takes
            return fake_run(self.argv)

    def fake_run(argv):
        o = dict(w.split("=", 1) for w in argv if "=" in w and not w.startswith("-"))
        done = lambda stdout="", rc=0, stderr="": subprocess.CompletedProcess(argv, rc, stdout, stderr)  # noqa: E731
        if argv[0] == "nvidia-smi":
            return done("NVIDIA H100 80GB HBM3, 570.86, 81559 MiB, 9.0\n")
        if "--version" in argv:
            return done("scaletrain 0.1.0\n")
        if "--env-json" in argv:
            return done(json.dumps(H100))
        if argv[1].endswith("cp_kernels.py"):  # one JSON line per backend and cp
            return done('{"backend": "FLASH_ATTENTION", "cp": 2, "max_abs_diff": 0.0039, "atol": 0.02, "ok": true}\n')
        if "--configured-only" in argv:  # the planner for this device: 9 fit without activation checkpointing, 18 with
            mb = 18 if o["parallel.activation_checkpointing"] == "true" else 9
            plan = {"chosen": "fsdp", "max_micro_batch": mb, "candidates": [{"strategy": "fsdp", "fits": True,
                                                                             "memory": {"peak": 2**34}}]}  # fmt: skip
            return done(json.dumps(plan))
        if "--calibrate" in argv:  # the clock's table for this GPU, named on the last line
            table = tmp_path / "clock-table.json"
            mm = {"bfloat16": [[4096, 4096, 4096, 7.0e14], [2048, 8192, 2048, 6.5e14]]}
            table.write_text(json.dumps({"matmul": mm, "memory_bytes_per_s": 3.3e12, "host_op_s": 1.1e-5}))
            return done("calibrating\n" + json.dumps({"kind": "h100", "path": str(table)}) + "\n")
        if "clock-gpu" in argv:  # every recorded run predicted with that table
            rows = [{"name": "1b eager", "where": "2026-11-28-h200", "measured_s": 0.672, "predicted_s": 0.70, "error": 0.042}]
            return done("planning 1 run\n" + json.dumps(rows, indent=1) + "\n")
        if "--measure" in argv:
            measured = {"peak": 1.9e9, "cuda_max_allocated": 1.6e9}
            out = {"strategy": o["parallel.strategy"], "world": 1, "predicted": {"peak": 2e9}, "measured": measured}
            return done("measuring 3 steps\n" + json.dumps(out) + "\n")
        if hooks.get("oom", lambda o: False)(o):
            return done(rc=1, stderr="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
        syncs = hooks.get("host_syncs", lambda o: [CLEAN, CLEAN])(o)
        loss = hooks.get("loss", lambda step: 11.8 - 0.1 * step)
        profiled = "telemetry.profile_steps" in o and not hooks.get("no_trace")
        run = (int(o["train.steps"]), o["parallel.strategy"], o["precision"] == "fp16", syncs, loss, profiled)
        fake_run_dir(Path(o["run.dir"]), *run)
        return done("training finished\n")

    monkeypatch.chdir(tmp_path)  # main changes into the repository; this changes back afterwards
    monkeypatch.setattr(checklist.shutil, "which", lambda program: program)  # nvidia-smi "is there"
    monkeypatch.setattr(checklist.launch, "Launched", FakeProcess)
    monkeypatch.setattr(checklist, "time", SimpleNamespace(monotonic=lambda: clock[0], strftime=time.strftime))
    return commands, hooks


def eager_mb8(o: dict[str, str]) -> bool:
    """The 1b eager run at micro-batch 8 without activation checkpointing: out of memory."""
    ac = o.get("parallel.activation_checkpointing")
    return o.get("train.micro_batch") == "8" and o.get("train.compile") == "false" and ac == "false"


@pytest.mark.unit
def test_gpu_mode_with_faked_processes(checklist, fake_gpu, capsys, tmp_path):
    """An H100 without nvcc, as the processes report it; the 1b eager run at micro-batch 8 runs out of memory
    (FAIL, retried at 4); no budget: every check runs, part 6 too, each command given STEP_TIMEOUT."""
    commands, hooks = fake_gpu
    hooks["oom"] = eager_mb8
    hooks["takes"] = lambda argv: 1  # each command a second of the faked clock
    out = tmp_path / "out"
    assert checklist.main([str(out)]) == 1  # the out-of-memory attempt counts as a failure
    got, printed = results(out), capsys.readouterr().out
    assert list(got) == [  # in the list's order, the templates filled, the retry after the attempt
        *ENV, *(f"{e}-bf16" for e in FIVE), *MB, "1b-eager-mb8", "1b-eager-mb4", *filled(RUNS_1B[1:]), *PLANNER, *MORE,
        *filled(LEFT), *FP16,
    ]  # fmt: skip
    assert {n for n, r in got.items() if r["status"] == "FAIL"} == {"1b-eager-mb8"}
    assert got["DeepSpeed optimizer"]["status"] == "WARN" and not {*CPU_CHECKS[2:], GPU_SKIPPED} & set(got)
    assert got["DeepSpeed optimizer"]["detail"] == (
        "no nvcc to build FusedAdam: ZeRO without offload uses torch's AdamW (DS_OPTIMIZER=auto)"
    )
    assert [r["part"] for r in got.values()] == sorted(r["part"] for r in got.values())  # in the list's order
    assert not any(r["status"] == "SKIP" for r in got.values())  # no budget: everything, part 6 too
    assert all(timeout == 900 for _, timeout in commands) and len(commands) == len(got) - 2  # two without a command
    assert all(got[n]["seconds"] == (1.0 if got[n]["cmd"] else 0.0) for n in got)
    for engine in (*FIVE, "zero1", "fsdp-offload"):
        for precision, steps in (("bf16", 3), ("fp16", 10)):
            if f"{engine}-{precision}" not in got:  # zero1 and fsdp-offload: bf16 only
                assert engine in ("zero1", "fsdp-offload") and precision == "fp16"
                continue
            r = got[f"{engine}-{precision}"]
            assert r["status"] == "PASS" and r["data"]["steps"] == steps and f"precision={precision}" in r["cmd"]
            assert r["detail"].endswith(", 1 fp16 steps skipped (1 s)") == (precision == "fp16"), r["detail"]
            # No nvcc: torch's AdamW for ZeRO without offload, and for nothing else.
            assert (checklist.TORCH_ADAM in r["cmd"]) == (engine in ("zero1", "zero2", "zero3")), r["cmd"]
    assert got["ddp-bf16"]["cmd"] == (
        f"{ST} train model.preset=small run.device=cuda train.log_every=1 parallel.strategy=ddp precision=bf16 "
        f"train.steps=3 checkpoint.every=0 train.resume=never run.dir={out}/runs/ddp-bf16"
    )
    assert got["zero2-bf16"]["cmd"] == (
        f"{ST} train model.preset=small run.device=cuda train.log_every=1 parallel.strategy=zero2 "
        f"'{checklist.TORCH_ADAM}' precision=bf16 train.steps=3 checkpoint.every=0 train.resume=never "
        f"run.dir={out}/runs/zero2-bf16"
    )
    assert got["ddp-bf16"]["detail"] == "loss 11.700 -> 11.500, 40,000 tok/s, MFU 42.0%, peak 60.00 GiB (1 s)"
    # Part 3: the plans for this device, the micro-batch, the out-of-memory retry at half of it, back to 8 after.
    assert got["plan 1b AC=false"]["cmd"].endswith(
        "parallel.activation_checkpointing=false train.micro_batch=1 --gpus-per-node 1 --gpu h100 "
        "--gpu-memory 85029158912B --configured-only --json"
    )
    assert got["plan 1b AC=true"]["detail"] == "largest micro-batch that fits: 18 (peak at micro-batch 1: 16.0 GiB) (1 s)"
    assert got["MFU 1b"]["detail"] == (
        "micro-batch 8 x 2048 tokens, activation checkpointing false (the planner: up to 9 without AC, 18 with)"
    )
    assert got["1b-eager-mb8"]["detail"] == f"exit 1, log {out}/logs/1b-eager-mb8.log (1 s)"
    assert "\n       | torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n" in printed
    assert "\n     out of memory at micro-batch 8: once more at 4\n" in printed
    assert printed.count("once more at") == 1  # the retry trained: no further halving
    assert "train.micro_batch=4 " in got["1b-eager-mb4"]["cmd"] and "train.compile=true" in got["1b-compiled-mb8"]["cmd"]
    assert "train.micro_batch=8 " in got["1b-compiled-mb8"]["cmd"] and "train.float8=true" in got["1b-float8-compiled-mb8"]["cmd"]
    assert {got[n]["check"] for n in ("1b-eager-mb8", "1b-eager-mb4")} == {"1b-eager-mb{mb}{ac_tag}"}
    assert got["1b-eager-mb8-AC"]["cmd"].endswith(
        "train.micro_batch=8 train.log_every=5 'telemetry.profile_steps=[5,5]' parallel.activation_checkpointing=true "
        "train.compile=false train.steps=20 "
        f"checkpoint.every=0 train.resume=never run.dir={out}/runs/1b-eager-mb8-AC"
    )
    # gpu_checklist_times.measured: the seconds per check as GPU_S names them, a retry's attempts added.
    measured = checklist.times.measured(out / "results.jsonl")
    assert set(measured) == set(checklist.times.GPU_S) and measured["1b-eager-mb{mb}{ac_tag}"] == 2.0
    # Part 5.
    assert got["moe-small-bf16"]["status"] == got["oom-1b-mb64"]["status"] == "PASS"
    assert got["moe-small-bf16"]["detail"] == (
        "0 reads in 2 steps, 1 at the flush: {}; loss 11.700 -> 11.400, 40,000 tok/s, MFU 42.0%, peak 60.00 GiB (1 s)"
    )
    assert got["moe-small-bf16"]["data"]["host_syncs"] == CLEAN
    assert got["moe-small-bf16"]["cmd"] == (
        f"{ST} train model.preset=small run.device=cuda train.log_every=1 'model.moe={{}}' parallel.strategy=fsdp "
        "precision=bf16 telemetry.host_syncs=true train.log_every=2 train.steps=4 checkpoint.every=0 train.resume=never "
        f"run.dir={out}/runs/moe-small-bf16"
    )
    assert "train.global_batch=64 train.micro_batch=64 train.steps=3" in got["oom-1b-mb64"]["cmd"]
    assert got["document-mask-bf16"]["status"] == "PASS" and "data.document_mask=true" in got["document-mask-bf16"]["cmd"]
    assert got["cp-attention-kernels"]["status"] == "PASS" and "FLASH_ATTENTION" in got["cp-attention-kernels"]["detail"]
    # The clock's table copied into OUT beside its summary, and every recorded run judged with it.
    assert got["clock-calibrate"]["detail"] == (
        "h100: 2 matmul shapes in bf16 at 650-700 TFLOP/s, memory 3.30 TB/s, host 11.0 us per operation (1 s)"
    )
    assert json.loads((out / "clock-table-h100.json").read_text())["host_op_s"] == 1.1e-5
    assert got["clock-gpu"]["detail"] == "1 of 1 runs within 15%, median |error| 4.2%, largest 4.2% (1 s)"
    assert "| 1b eager (2026-11-28-h200) | 0.672 | 0.7 | +4.2% |" in (out / "clock-gpu.md").read_text()
    # Every run once, in order (the 1b eager one twice: the retry).
    run_dirs = [Path(dict(w.split("=", 1) for w in argv if "=" in w)["run.dir"]).name for argv, _ in commands if "train" in argv]
    assert run_dirs == [
        *(f"{e}-bf16" for e in FIVE), "1b-eager-mb8", "1b-eager-mb4", *filled(RUNS_1B[1:]),
        "moe-small-bf16", "document-mask-bf16", "oom-1b-mb64", "moe-v3-grouped-bf16", "moe-v3-loop-bf16", "long-1b-32k-AC",
        "long-1b-32k-AC-host-tiles", "zero1-bf16", "fsdp-offload-bf16", "1b-eager-mb8-AC", *FP16,
    ]  # fmt: skip
    assert sum(1 for argv, _ in commands if "plan" in argv) == 2 + 4 + 3 + 1  # + the clock's calibration
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# scaletrain GPU checklist: NVIDIA H100 80GB HBM3 (GPU mode)")
    assert "Wall time of the checklist: 39 s.\n" in summary  # the faked clock: 39 commands of a second
    assert "| 2 | zero2-bf16 | PASS | loss 11.700 -> 11.500, 40,000 tok/s, MFU 42.0%, peak 60.00 GiB (1 s) |" in summary
    assert "| small-zero3-bf16 | zero3 | 1.86 GiB | 1.77 GiB | +5.3% | 1.49 GiB | +25.0% |" in summary
    assert "| 1b-compiled-mb8 | 40,000 | 42.0% | 400.0 | 60.00 GiB | 989 TFLOP/s (table) | PASS |" in summary
    # The traced step of each MFU run (step 5): the device's time by kind of kernel, and its idle time.
    assert got["1b-compiled-mb8"]["detail"].endswith("peak 60.00 GiB; step 5: matmul 60%, attention 20%, idle 20% (1 s)"), got[
        "1b-compiled-mb8"
    ]["detail"]
    assert "telemetry.profile_steps=[5,5]" in got["1b-float8-compiled-mb8"]["cmd"]
    assert got["1b-eager-mb8-AC"]["data"]["profile"]["kernel_s"] == {"attention": 1e-4, "matmul": 3e-4}
    assert "| 1b-eager-mb4 | 0.3 (60%) | 0.1 (20%) | - | - | - | - | - | - | 0.1 (20%) | 0.5 |" in summary
    assert "| 1b-compiled-mb8 | nvjet_hsh_256x128 | 0.2 | 1 |" in summary
    assert "| 1b-eager-mb8-AC | - | 100.0 (25%) | 250.0 (62%) | 50.0 (12%) | - | - | 400.0 |" in summary
    assert "| ddp-fp16 | ddp | none (one process, no DDP wrapper) | 11.700 | 10.800 |" in summary
    assert "| fsdp-bf16 | fsdp | nccl (group of one) |" in summary
    assert printed.rstrip().endswith(f"summary: {out}/summary.md (GPU mode, 39 s, 1 failed)\nFAIL: 1 check(s) failed")


@pytest.mark.unit
def test_the_host_reads_of_a_step_give_warn_and_a_run_that_does_not_count_them_fails(checklist, fake_gpu, tmp_path):
    """moe-small-bf16's judge: the last (steady) interval's reads inside its steps; the first holds start-up."""
    commands, hooks = fake_gpu
    sites = {"scaletrain/models/moe.py:212 _experts: tolist": 2, "scaletrain/trainer.py:431 step: item": 1}
    cases = {  # the intervals' host reads -> status, the detail's start, exit code
        "read": ([CLEAN, {"step": 3, "flush": 1, "sites": sites}], "WARN", f"3 reads in 2 steps, 1 at the flush: {sites}; ", 0),
        "none": ([None, None], "FAIL", "no host_syncs in the interval rows; ", 1),
        "start-up": ([{"step": 5, "flush": 1, "sites": sites}, CLEAN], "PASS", "0 reads in 2 steps, 1 at the flush: {}; ", 0),
    }
    for case, (syncs, status, start, code) in cases.items():
        hooks["host_syncs"] = lambda o, syncs=syncs: syncs
        out = tmp_path / case
        assert checklist.main([str(out), "--only", "moe-small-*"]) == code, case
        got = results(out)
        assert list(got) == [*ENV, "moe-small-bf16"]  # part 1 always, then only the check named
        r = got["moe-small-bf16"]
        assert (
            r["status"] == status
            and r["detail"] == f"{start}loss 11.700 -> 11.400, 40,000 tok/s, MFU 42.0%, peak 60.00 GiB (0 s)"
        )
        assert r["data"]["host_syncs"] == syncs[-1] and r["data"]["steps"] == 4
    # A run that trained wrong stays FAIL, its reads counted all the same.
    hooks["host_syncs"], hooks["loss"] = lambda o: [CLEAN, {"step": 1, "flush": 1, "sites": sites}], lambda s: 11 + 0.1 * s
    assert checklist.main([str(tmp_path / "wrong"), "--only", "moe-*"]) == 1
    r = results(tmp_path / "wrong")["moe-small-bf16"]
    assert r["status"] == "FAIL" and r["detail"] == (
        f"1 reads in 2 steps, 1 at the flush: {sites}; loss did not fall (11.1000 -> 11.4000); "
        "loss 11.100 -> 11.400, 40,000 tok/s, MFU 42.0%, peak 60.00 GiB (0 s)"
    )
    assert [argv[-1] for argv, _ in commands if "model.moe={}" in argv] == [
        f"run.dir={tmp_path}/{d}/runs/moe-small-bf16" for d in (*cases, "wrong")
    ]


@pytest.mark.unit
def test_a_check_that_does_not_fit_the_budget_is_skipped_and_a_later_one_that_fits_runs(checklist, fake_gpu, monkeypatch, capsys, tmp_path):  # fmt: skip
    commands, hooks = fake_gpu
    table = dict(checklist.times.GPU_S)
    monkeypatch.setattr(checklist.times, "GPU_S", table)
    table["zero2-bf16"] = 1000
    out = tmp_path / "out"
    assert checklist.main([str(out), "--budget", "300"]) == 0
    got, printed = results(out), capsys.readouterr().out
    assert got["zero2-bf16"]["status"] == "SKIP" and got["zero2-bf16"]["detail"].startswith("budget: expects ~1000 s")
    assert got["zero2-bf16"]["detail"].endswith("s left of --budget 300") and "strategy=zero2" in got["zero2-bf16"]["cmd"]
    assert re.search(r"^SKIP \[2\] zero2-bf16: budget: expects ~1000 s \(measured\), 295 s left of --budget 300$", printed, re.M)
    assert f"\n       $ {got['zero2-bf16']['cmd']}\n" in printed and "seconds" not in got["zero2-bf16"]  # what would have run
    assert got["zero3-bf16"]["status"] == "PASS" and got["zero3-offload-bf16"]["status"] == "PASS"
    assert got["1b-compiled-mb8"]["status"] == got["1b-float8-compiled-mb8"]["status"] == "PASS"
    assert [n for n, r in got.items() if r["status"] == "SKIP"] == ["zero2-bf16"]
    assert not any("zero2-bf16" in " ".join(argv) for argv, _ in commands)
    assert all(timeout == 295 for _, timeout in commands)  # the budget's end, before STEP_TIMEOUT's
    assert len(commands) == len(got) - 3  # all but the skip and the two without a command: part 6 too

    # A check that takes longer than expected: it ends where the budget ends, and so does the checklist.
    table["1b-compiled-mb{mb}{ac_tag}"] = 280
    hooks["takes"] = lambda argv: 295 if "train.compile=true" in argv else 0
    commands.clear()
    assert checklist.main([str(out), "--budget", "300"]) == 0
    got, printed = results(out), capsys.readouterr().out
    assert got["1b-compiled-mb8"]["status"] == "PASS" and commands[-1][1] == 295  # its timeout: all that was left
    after = list(got)[list(got).index("1b-compiled-mb8") + 1 :]
    assert after == ["1b-float8-compiled-mb8", *PLANNER, *MORE, *filled(LEFT), *FP16]
    assert all(got[n]["status"] == "SKIP" and got[n]["detail"].startswith("budget:") for n in after)
    assert got["1b-float8-compiled-mb8"]["detail"] == "budget: expects ~76 s (measured), 0 s left of --budget 300"
    assert got["1b-float8-compiled-mb8"]["cmd"].endswith(f"run.dir={out}/runs/1b-float8-compiled-mb8")
    assert f"summary: {out}/summary.md (GPU mode, 295 s, 0 failed)" in printed

    # One that takes longer than that: killed where the budget ends, with what it wrote until then.
    hooks["takes"] = lambda argv: 400 if "train.compile=true" in argv else 0
    assert checklist.main([str(out), "--budget", "300"]) == 1
    got = results(out)
    log = out / "logs" / "1b-compiled-mb8.log"
    assert got["1b-compiled-mb8"]["status"] == "FAIL" and commands[-1][1] == 295
    assert got["1b-compiled-mb8"]["detail"] == f"killed after 295 s (the budget's end), log {log} (295 s)"
    assert log.read_text() == "step 1 ...\n\ngpu_checklist: killed after 295 s (the budget's end)\n"
    assert list(got)[list(got).index("1b-compiled-mb8") + 1 :] == after
    assert all(got[n]["status"] == "SKIP" for n in after)

    # The plans skipped: no micro-batch, so neither its line (which would fail) nor the runs that need it.
    hooks.pop("takes")
    table.update({"plan 1b AC=false": 1000, "plan 1b AC=true": 1000})
    assert checklist.main([str(out), "--budget", "300"]) == 0
    got = results(out)
    assert [n for n, r in got.items() if r["status"] == "SKIP"] == ["zero2-bf16", "plan 1b AC=false", "plan 1b AC=true"]
    assert "MFU 1b" not in got and [n for n in got if n.startswith("1b-")] == list(PLANNER[:3])
    assert not any("{" in n for n in got)
    assert list(got) == [*ENV, *(f"{e}-bf16" for e in FIVE), *MB[:2], *PLANNER, *MORE, *LEFT[:2], *LEFT[3:], *FP16]


class Killed(BaseException):
    """What a kill at the device tool's limit does to the checklist: it stops wherever it is."""


@pytest.mark.unit
def test_results_and_summary_are_on_disk_before_the_next_command_starts(checklist, fake_gpu, tmp_path):
    """Before each command starts, results.jsonl, summary.md and logs.tar.gz (with --work) hold every result
    so far; then a run killed at the fourth engine leaves what it had."""
    commands, hooks = fake_gpu
    out, work, seen = tmp_path / "out", tmp_path / "work", []

    def snapshot(argv):
        lines = (out / "results.jsonl").read_text().splitlines()
        summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
        members = set()
        if (out / "logs.tar.gz").exists():
            with tarfile.open(out / "logs.tar.gz") as tar:
                members = set(tar.getnames())
        rows = re.findall(r"^\| \d \| (.+?) \| (?:PASS|FAIL|WARN|SKIP) \|", summary, re.M)
        seen.append((shlex.join(argv), [json.loads(ln)["name"] for ln in lines], rows, summary, members))

    hooks["before"], hooks["oom"] = snapshot, eager_mb8
    assert checklist.main([str(out), "--work", str(work), "--budget", "3000"]) == 1
    got = results(out)
    names, cmds = list(got), [r["cmd"] for r in got.values()]
    assert len(seen) == len(commands) == 39
    for cmd, in_results, in_summary, summary, members in seen:
        before = names[: cmds.index(cmd)]  # every result before this command's check
        assert in_results == before and in_summary == before, cmd
        assert not before or "so far (still running, or stopped)." in summary
        logs = {f"logs/{slug(n)}.log" for n in before if got[n]["cmd"]}
        wrote = [n for n in before if "run.dir=" in got[n]["cmd"] and n != "1b-eager-mb8"]  # out of memory: nothing
        run_files = {f"runs/{n}/{f}" for n in wrote for f in ("config.yaml", "metrics.jsonl", "run.json")}
        assert members == logs | run_files, cmd
    assert "so far" not in (out / "summary.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == [
        "clock-gpu.md",  # the clock's comparison and its table (issue 55)
        "clock-table-h100.json",
        "env.json",
        "logs.tar.gz",
        "results.jsonl",
        "summary.md",
    ]
    assert (work / "logs" / "1b-eager-mb8.log").read_text().startswith("torch.OutOfMemoryError")

    # Killed partway, as the zero3 run starts: what was known until then stays, complete.
    def killed(argv):
        if "parallel.strategy=zero3" in argv and "precision=bf16" in argv and "parallel.offload_params=cpu" not in argv:
            raise Killed

    hooks["before"], out, work = killed, tmp_path / "killed", tmp_path / "killed-work"
    with pytest.raises(Killed):
        checklist.main([str(out), "--work", str(work), "--budget", "3000"])
    done = [*ENV, "ddp-bf16", "fsdp-bf16", "zero2-bf16"]
    assert list(results(out)) == done and all(r["status"] in ("PASS", "WARN") for r in results(out).values())
    summary = (out / "summary.md").read_text()
    assert "so far (still running, or stopped)." in summary
    assert re.findall(r"^\| \d \| (.+?) \| (?:PASS|WARN) \|", summary, re.M) == done
    assert "| zero2-bf16 | zero2 | nccl (group of one) | 11.700 | 11.500 | 40,000 | 60.00 GiB | PASS |" in summary
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {n for n in tar.getnames() if n.startswith("runs/zero2-bf16/")} == {
            "runs/zero2-bf16/config.yaml", "runs/zero2-bf16/metrics.jsonl", "runs/zero2-bf16/run.json"}  # fmt: skip
        assert tar.extractfile("logs/zero2-bf16.log").read() == b"training finished\n"
    assert json.loads((out / "env.json").read_text()) == H100
