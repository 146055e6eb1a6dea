"""The GPU checklist (docs/gpu.md): what scaletrain does on one NVIDIA GPU (H100/H200), in one go.

    .venv/bin/python scripts/gpu_checklist.py [OUT_DIR]   # OUT_DIR defaults to runs/gpu_checklist
    .venv/bin/python scripts/gpu_checklist.py --list      # every check with its exact command; runs nothing

CHECKS is the checklist, one entry per result line, in the manner of torchtitan's integration-test list;
main's loop runs each entry with the test helpers (tests/helpers.py) and writes, under OUT_DIR, results.jsonl,
summary.md (the tables for docs/gpu.md), env.json, logs/ and runs/. Without a CUDA device (or with
FORCE_CPU=1) parts 2 and 3 run as CPU stand-ins. Exit code 1 if a check failed, else 0.
Knobs (environment variables): STEP_TIMEOUT (seconds a command may run, 900), ENGINE_STEPS (20 on GPU,
10 on CPU), MFU_STEPS (30), MFU_MAX_MB (16), DS_OPTIMIZER (auto | fused | torch: see part 1),
KEEP_CHECKPOINTS=1 (keep each run's final checkpoint; a 1b one is ~15 GB), FORCE_CPU=1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from scaletrain.telemetry import read_metrics  # noqa: E402

import helpers  # noqa: E402  (how the tests start processes, kill them, and read what a run wrote)

knob = lambda name, default: int(os.environ.get(name) or default)
STEP_TIMEOUT, MFU_STEPS, MFU_MAX_MB = knob("STEP_TIMEOUT", 900), knob("MFU_STEPS", 30), knob("MFU_MAX_MB", 16)
GPU_STEPS, CPU_STEPS = knob("ENGINE_STEPS", 20), knob("ENGINE_STEPS", 10)
DS_OPTIMIZER = os.environ.get("DS_OPTIMIZER", "auto")
KEEP_CHECKPOINTS, FORCE_CPU = os.environ.get("KEEP_CHECKPOINTS") == "1", os.environ.get("FORCE_CPU") == "1"
# A command's first word: this interpreter, so that the checklist runs the scaletrain it imports itself.
PROGRAMS = {"scaletrain": [sys.executable, "-m", "scaletrain"], "python": [sys.executable]}


@dataclass(frozen=True)
class Check:
    name: str  # unique; part 4's are templates of the micro-batch the planner allows ({mb}, {ac_tag})
    part: int
    descr: str
    argv: tuple[str, ...] = ()  # "scaletrain ..." or another program; (): judged from what earlier checks found
    judge: str = "first_line"  # the judge_* function that turns what it printed or wrote into PASS / FAIL / WARN
    needs: frozenset[str] = frozenset()  # "cuda" (GPU mode), "no-cuda" (the CPU stand-ins), or facts found before
    steps: int = 0  # > 0: a training run of this many steps, into OUT_DIR/runs/NAME
    retry_oom: bool = False  # out of memory: once more at half the micro-batch (the first attempt still fails)


CUDA, NO_CUDA = frozenset({"cuda"}), frozenset({"no-cuda"})
# ZeRO without offload: nothing, or torch's AdamW inside DeepSpeed where no nvcc can build FusedAdam (part 1).
DS = "{ds_extra}"
TORCH_ADAM = "parallel.deepspeed_extra={optimizer: {params: {torch_adam: true}}}"
# Part 2 on CUDA uses the small preset: whether each engine trains on the GPU, not a speed figure (part 4
# is). ddp at world 1 is one process without a group; fsdp and ZeRO make a group of one (NCCL on CUDA).
SMALL = ("model.preset=small", "run.device=cuda", "train.log_every=5")
ENGINES = {
    "ddp": ("parallel.strategy=ddp",),
    "fsdp": ("parallel.strategy=fsdp",),
    **{z: (f"parallel.strategy={z}", DS) for z in ("zero1", "zero2", "zero3")},
    # CPU offload: DeepSpeedCPUAdam (a C++ op built with the host compiler) and FSDP2's CPUOffloadPolicy.
    "zero3-offload": ("parallel.strategy=zero3", "parallel.offload_optimizer=cpu", "parallel.offload_params=cpu"),
    "fsdp-offload": ("parallel.strategy=fsdp", "parallel.offload_params=cpu"),
}
TINY = ("model.preset=tiny", "run.device=cpu", "precision=fp32")
PLAN_SMALL = ("model.preset=small", "data.seq_len=256", "train.micro_batch=8", "run.device=cuda")
# The 1b preset at its published vocabulary (Llama 3.2 1B, 1.24B parameters). A built-in preset takes
# the tokenizer's vocabulary (4096 here) unless model.vocab_size is set, while the planner has no
# tokenizer and plans 128256; a larger vocabulary than the tokenizer's is allowed (ids past 4096 never
# occur), so plan and run describe one model, comparable with published MFU figures.
BIG = ("model.preset=1b", "model.vocab_size=128256", "data.seq_len=2048", "precision=bf16")
BIG_CUDA = (*BIG, "run.device=cuda")
PLAN_1B = ("--gpus-per-node", "1", "--gpu", "{gpu_kind}", "--gpu-memory", "{gpu_memory}B", "--configured-only", "--json")
MFU = (*BIG_CUDA, "parallel.strategy=fsdp", "train.micro_batch={mb}", "train.log_every=5")
AC = "parallel.activation_checkpointing"

# A table, one check or one generated family of checks per entry, laid out by hand.
# fmt: off
CHECKS = [
    Check("nvidia-smi", 1, "the GPUs the driver sees (SKIP without nvidia-smi)",
          ("nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"), "nvidia_smi"),
    Check("scaletrain CLI", 1, "the CLI starts", ("scaletrain", "--version")),
    # A process of its own: the driver never touches CUDA, whose context would hold memory the runs need.
    Check("python/torch/deepspeed", 1, "versions and the device; FAIL where nvidia-smi lists a GPU torch cannot use",
          ("python", str(Path(__file__).resolve()), "--env-json"), "env"),
    # DeepSpeed JIT-builds FusedAdam (its optimizer on GPU without offload) with nvcc; pip's torch brings none.
    Check("DeepSpeed optimizer", 1, "FusedAdam where nvcc can build it, else WARN and torch's AdamW (DS_OPTIMIZER)",
          judge="ds_optimizer", needs=CUDA),
    *(Check(f"{e}-{p}", 2, f"{e} trains in {p} on CUDA", ("scaletrain", "train", *SMALL, *o, f"precision={p}"),
            "trains", CUDA, GPU_STEPS) for p in ("bf16", "fp16") for e, o in ENGINES.items()),
    # A mixture of experts (issue 27): on CUDA in bf16 its experts run as one torch._grouped_mm; the
    # small preset with 8 experts, top-2 (model.moe={}); its MFU counts the active experts only.
    Check("moe-small-bf16", 2, "a mixture of experts trains in bf16 on CUDA (the grouped matmul)",
          ("scaletrain", "train", *SMALL, "model.moe={{}}", "parallel.strategy=fsdp", "precision=bf16"), "trains", CUDA,
          GPU_STEPS),
    # Document masking (issue 28): on CUDA the attention is FlexAttention's compiled block-mask kernel.
    Check("document-mask-bf16", 2, "data.document_mask trains in bf16 on CUDA (FlexAttention's block mask)",
          ("scaletrain", "train", *SMALL, "data.document_mask=true", "parallel.strategy=fsdp", "precision=bf16"), "trains",
          CUDA, GPU_STEPS),
    # Context parallel (issue 29): each chunk's queries on the flash and cuDNN kernels (causal_lower_right)
    # equal full causal attention's rows in bf16 (scripts/cp_kernels.py; one JSON line per backend and cp).
    Check("cp-attention-kernels", 2, "context parallel's chunk attention on flash and cuDNN equals full causal rows",
          ("python", str(Path(__file__).resolve().parent / "cp_kernels.py")), "first_line", CUDA),
    # A real out-of-memory error (issue 26): micro-batch 64 of the 1b preset cannot fit; one process retries
    # in place at half the micro-batch (same global batch) until it does, and trains.
    Check("oom-1b-mb64", 2, "a real out-of-memory error survived: micro-batch 64 halved until it fits",
          ("scaletrain", "train", *BIG_CUDA, "parallel.strategy=fsdp", "train.global_batch=64", "train.micro_batch=64"),
          "trains", CUDA, 10),
    *(Check(f"{e}-cpu", 2, f"{e} trains on CPU (stand-in)", ("scaletrain", "train", *TINY, "train.log_every=5", *o),
            "trains", NO_CUDA, CPU_STEPS)
      for e, o in {"ddp": ("parallel.strategy=ddp",), "fsdp": ("parallel.strategy=fsdp",),
                   # DeepSpeed's default bucket (5e7 elements) made a tiny zero2 step 4.4 s on 2 cores, not 0.25 s.
                   "zero2": ("parallel.strategy=zero2", "parallel.bucket_size=2000000")}.items()),
    # Part 3: three real steps under torch's MemTracker (on CUDA also max_memory_allocated). The error is
    # reported, not judged: FAIL only when the command fails; beyond 15% (the CPU tests' bound) is marked.
    *(Check(n, 3, "the planner's peak against a measured one", ("scaletrain", "plan", *cfg, "--measure", "--json"),
            "measure", CUDA) for n, cfg in {
        "small-ddp-fp32": (*PLAN_SMALL, "parallel.strategy=ddp", "precision=fp32"),
        "small-fsdp-bf16": (*PLAN_SMALL, "parallel.strategy=fsdp", "precision=bf16"),
        "small-zero2-bf16": (*PLAN_SMALL, "parallel.strategy=zero2", "precision=bf16", DS),
        "small-zero3-bf16": (*PLAN_SMALL, "parallel.strategy=zero3", "precision=bf16", DS),
        "1b-fsdp-bf16-AC-mb4": (*BIG_CUDA, "parallel.strategy=fsdp", f"{AC}=true", "train.micro_batch=4"),
        "1b-fsdp-bf16-mb2": (*BIG_CUDA, "parallel.strategy=fsdp", "train.micro_batch=2"),
        "1b-zero3-bf16-AC-mb4": (*BIG_CUDA, "parallel.strategy=zero3", f"{AC}=true", "train.micro_batch=4", DS)}.items()),
    # One torch engine and one DeepSpeed engine; on a CPU mostly start-up.
    *(Check(f"tiny-{s}-cpu", 3, "the planner's peak against a measured one on CPU (stand-in)",
            ("scaletrain", "plan", *TINY, f"parallel.strategy={s}", "--measure", "--json"), "measure", NO_CUDA)
      for s in ("ddp", "zero2")),
    # Part 4: the largest micro-batch the planner says fits this device (its memory as torch reports it).
    *(Check(f"plan 1b AC={ac}", 4, "the largest micro-batch that fits",
            ("scaletrain", "plan", *BIG, "parallel.strategy=fsdp", f"{AC}={ac}", "train.micro_batch=1", *PLAN_1B),
            "plan_mb", CUDA) for ac in ("false", "true")),
    Check("MFU 1b", 4, "the runs' micro-batch: the largest power of two within the plan and MFU_MAX_MB; activation "
          "checkpointing (a recompute of each block) only where nothing fits without", judge="micro_batch", needs=CUDA),
    *(Check(f"1b-{how}-mb{{mb}}{{ac_tag}}", 4, f"MFU, {how}",
            ("scaletrain", "train", *MFU, f"{AC}={{ac}}", f"train.compile={str(how == 'compiled').lower()}"),
            "trains", CUDA | {"micro-batch"}, MFU_STEPS, retry_oom=True) for how in ("eager", "compiled")),
    Check("1b-eager-mb{mb}-AC", 4, "what activation checkpointing costs, where the runs above went without",
          ("scaletrain", "train", *MFU, f"{AC}=true", "train.compile=false"), "trains",
          CUDA | {"micro-batch", "no-ac-needed"}, MFU_STEPS, retry_oom=True),
]
# fmt: on
PHASES = ("data_s", "forward_s", "backward_s", "optimizer_s", "comm_s", "other_s")


class Context(dict):  # what earlier checks found (env, facts, ds_extra, mb, ...)
    __missing__ = lambda self, key: "{" + key + "}"  # a template key not known yet stays as it is


def command(c: Check, name: str, ctx: Context, extra: list[str]) -> list[str]:
    words = [v for w in c.argv for v in (ctx.get("ds_extra", [w]) if w == DS else [w.format_map(ctx)])]
    if c.steps:  # train.resume=never: a rerun into the same OUT_DIR must not resume the last one and train zero steps
        words += [f"train.steps={c.steps}", "checkpoint.every=0", "train.resume=never", f"run.dir={OUT / 'runs' / name}"]
    if words[1:2] in (["train"], ["plan"]):  # --set: after the other overrides, so that it wins
        at = max(i for i, w in enumerate(words) if "=" in w and not w.startswith("-")) + 1
        words[at:at] = extra
    return PROGRAMS.get(words[0], words[:1]) + words[1:] if words else []


# ---------------------------------------------------------------- judges: (process, context) -> (status, detail, data)

fmt = lambda x, spec="{:,.0f}": "-" if x is None else spec.format(x)
pct = lambda x, spec="{:.1f}%": fmt(None if x is None else 100 * x, spec)
size = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"
median = lambda xs: statistics.median(v) if (v := [x for x in xs if x is not None]) else None
overrides = lambda proc: dict(w.split("=", 1) for w in proc.args if "=" in w and not w.startswith("-"))


def judge_first_line(proc, ctx):
    return "PASS", (proc.stdout + proc.stderr).strip().splitlines()[0], None


def judge_nvidia_smi(proc, ctx):
    gpus = ctx["smi_gpus"] = proc.stdout.strip().splitlines()
    return "PASS", f"{gpus[0]} ({len(gpus)} GPU(s))", None


def judge_env(proc, ctx):
    e = ctx["env"] = json.loads(proc.stdout)
    (OUT / "env.json").write_text(proc.stdout)
    ctx["cuda"] = e["cuda_available"] and not FORCE_CPU
    line = "python {python}, torch {torch} (CUDA {torch_cuda}), deepspeed {deepspeed}, cuda available: {cuda_available}"
    line = line.format(**e)
    if e["cuda_available"]:
        gpu = ", {device_name} (sm {capability}, {gib:.1f} GiB, bf16 {bf16}, NCCL {nccl}, {device_count} device(s))"
        line += gpu.format(gib=e["device_memory"] / 2**30, **e)
        kind = next((k for k in ("h200", "a100") if k in e["device_name"].lower()), "h100")  # the planner's GPU table
        ctx.update(gpu_memory=e["device_memory"], gpu_kind=kind)
    problems = [] if e["deepspeed"] else ["deepspeed is not installed"]
    if ctx.get("smi_gpus") and not e["cuda_available"]:  # a CPU wheel of torch, or a driver too old for it
        problems.append("nvidia-smi lists a GPU but torch.cuda.is_available() is False")
    return ("FAIL" if problems else "PASS"), "; ".join([line, *problems]), None


def judge_ds_optimizer(proc, ctx):
    nvcc = ctx["env"].get("nvcc")
    ctx["ds_extra"] = [TORCH_ADAM] if DS_OPTIMIZER == "torch" or (DS_OPTIMIZER == "auto" and not nvcc) else []
    if ctx["ds_extra"]:
        return "WARN", f"no nvcc to build FusedAdam: ZeRO without offload uses torch's AdamW (DS_OPTIMIZER={DS_OPTIMIZER})", None
    return "PASS", f"FusedAdam, built by DeepSpeed with {nvcc or 'nvcc'} on first use (DS_OPTIMIZER={DS_OPTIMIZER})", None


def judge_trains(proc, ctx):
    """FAIL when a loss is not finite, the last is not below the first, or steps are missing."""
    run_dir, want = Path(overrides(proc)["run.dir"]), int(overrides(proc)["train.steps"])
    steps = helpers.metric_rows(run_dir)  # which asserts one row per step, in order
    losses = [r["loss"] for r in steps] or [math.nan]  # no rows: "not finite", and steps are missing
    intervals = [r for r in read_metrics(run_dir / "metrics.jsonl", events=True) if r.get("event") == "interval"]
    steady = intervals[1:] or intervals  # the first interval holds start-up (allocator warm-up, compilation)
    d = {k: helpers.run_info(run_dir).get(k) for k in ("engine", "backend", "device", "peak_flops", "peak_flops_source")}
    if not d["backend"]:  # run.json names none for one process; fsdp and DeepSpeed still make a process group of one
        group = ("nccl" if d["device"] == "cuda" else "gloo") + " (group of one)"
        d["backend"] = "none (one process, no DDP wrapper)" if d["engine"] == "ddp" else group
    d.update({k: median(r.get(k) for r in steady) for k in ("tokens_per_s", "mfu", "step_s")})
    d.update(steps=len(steps), first_loss=losses[0], last_loss=losses[-1])
    d["mem_peak_bytes"] = max((r.get("mem_peak_bytes") or 0 for r in intervals), default=None)
    d["phases"] = {k: median((r.get("phases") or {}).get(k) for r in steady) for k in PHASES}
    problems = [f"{len(steps)} of {want} steps"] if len(steps) < want else []
    if not all(map(math.isfinite, losses)):
        problems.insert(0, "a loss is not finite")
    elif not losses[-1] < losses[0]:
        problems.insert(0, f"loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})")
    line = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, {fmt(d['tokens_per_s'])} tok/s, MFU {pct(d['mfu'])}"
    line += f", peak {size(d['mem_peak_bytes'])}"
    if skipped := sum(1 for r in steps if r.get("skipped")):
        line += f", {skipped} fp16 steps skipped"
    return ("FAIL" if problems else "PASS"), "; ".join([*problems, line]), d


def judge_measure(proc, ctx):
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{") and '"predicted"' in ln][-1])
    p, m = out["predicted"], out["measured"]
    d = dict(strategy=out["strategy"], predicted=p["peak"], peak_phase=p.get("peak_phase"), measured=m.get("peak"))
    d["cuda_max_allocated"] = m.get("cuda_max_allocated")
    d["error"], d["error_cuda"] = (p["peak"] / d[k] - 1 if d[k] else None for k in ("measured", "cuda_max_allocated"))
    line = f"{d['strategy']}: predicted {size(d['predicted'])}, measured {size(d['measured'])} ({pct(d['error'], '{:+.1f}%')})"
    if d["cuda_max_allocated"]:
        line += f", cuda max_allocated {size(d['cuda_max_allocated'])} ({pct(d['error_cuda'], '{:+.1f}%')})"
    beyond = any(e is not None and abs(e) > 0.15 for e in (d["error"], d["error_cuda"]))
    return "PASS", line + (" [beyond 15%]" if beyond else ""), d


def judge_plan_mb(proc, ctx):
    plan, ac = json.loads(proc.stdout), overrides(proc)[AC]
    chosen = next(c for c in plan["candidates"] if c["strategy"] == plan["chosen"])
    mb, peak = plan["max_micro_batch"] if chosen["fits"] else 0, f"{chosen['memory']['peak'] / 2**30:.1f}"
    ctx[f"mb_{ac}"], ctx[f"peak_{ac}"] = mb, peak
    return "PASS", f"largest micro-batch that fits: {mb} (peak at micro-batch 1: {peak} GiB)", None


def judge_micro_batch(proc, ctx):
    without, with_ac = ctx.get("mb_false", 0), ctx.get("mb_true", 0)
    limit = min(without or with_ac, MFU_MAX_MB)
    if limit < 1:
        peaks = f"{ctx.get('peak_false', '-')} / {ctx.get('peak_true', '-')} GiB with AC"
        return "FAIL", f"the planner finds no micro-batch that fits (peak at micro-batch 1: {peaks})", None
    mb = 1 << (limit.bit_length() - 1)  # a power of two within the limit: the planner's error bound is ~15%
    ctx.update(mb=mb, ac=str(not without).lower(), ac_tag="" if without else "-AC")
    ctx["facts"] |= {"micro-batch", "no-ac-needed"} if without else {"micro-batch"}
    detail = f"micro-batch {mb} x 2048 tokens, activation checkpointing {ctx['ac']}"
    return "PASS", f"{detail} (the planner: up to {without} without AC, {with_ac} with)", None


JUDGES = {name.removeprefix("judge_"): f for name, f in list(globals().items()) if name.startswith("judge_")}


# ---------------------------------------------------------------- the driver


def run_check(c: Check, ctx: Context, extra: list[str]) -> bool:
    """Run one check, print its line and record it; returns whether it failed out of memory."""
    name = c.name.format_map(ctx)
    argv, t0, proc, status, data = command(c, name, ctx, extra), time.monotonic(), None, "FAIL", None
    log = OUT / "logs" / (re.sub(r"[^\w.=-]+", "-", name) + ".log")
    if argv and not shutil.which(argv[0]):
        report(c.part, name, "SKIP", f"{argv[0]} not found", "", None)
        return False
    if c.steps:
        shutil.rmtree(OUT / "runs" / name, ignore_errors=True)
    # A session of its own, output to files. one_thread=False: the helpers' default suits tests run two at a time.
    launched = helpers.Launched(argv, one_thread=False) if argv else None
    try:
        proc = launched.wait(STEP_TIMEOUT) if launched else None
        if proc:
            log.write_text(proc.stdout + proc.stderr)
        if proc and proc.returncode:
            detail = f"exit {proc.returncode}, log {log}"
        else:
            status, detail, data = JUDGES[c.judge](proc, ctx)
    except Exception as e:  # the helpers' timeout (they killed the whole tree), or output that cannot be read
        detail = f"{type(e).__name__}: {e}".splitlines()[0]
        if launched and proc is None:  # what it wrote until then stays in the helpers' files
            detail = f"killed after {STEP_TIMEOUT} s (STEP_TIMEOUT), log {log}"
            text = launched._read(launched._out) + launched._read(launched._err)
            log.write_text(f"{text}\ngpu_checklist: killed after {STEP_TIMEOUT} s (STEP_TIMEOUT)\n")
    report(c.part, name, status, detail + (f" ({time.monotonic() - t0:.0f} s)" if argv else ""), shlex.join(argv), data)
    text = log.read_text(errors="replace") if argv and log.exists() else ""
    if status == "FAIL" and text:
        print("\n".join(f"       | {ln}" for ln in text.splitlines()[-15:]))
    if c.steps and not KEEP_CHECKPOINTS:
        shutil.rmtree(OUT / "runs" / name / "checkpoints", ignore_errors=True)
    return status == "FAIL" and bool(re.search(r"out of memory|OutOfMemoryError", text, re.IGNORECASE))


def report(part, name, status, detail, cmd, data):
    print(f"{status:<4} [{part}] {name}: {detail}" + (f"\n       $ {cmd}" if cmd else ""), flush=True)
    RESULTS.append(dict(part=part, name=name, status=status, detail=detail, cmd=cmd, **({"data": data} if data else {})))
    with open(OUT / "results.jsonl", "a") as f:
        f.write(json.dumps(RESULTS[-1]) + "\n")


def main(argv: list[str] | None = None) -> int:
    global OUT
    p = argparse.ArgumentParser(epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", nargs="?", default="runs/gpu_checklist", help="where everything is written")
    p.add_argument("--list", action="store_true", help="print every check with its exact command, run nothing")
    p.add_argument("--only", action="append", metavar="PATTERN", help="of parts 2-4, only the checks so named (fnmatch)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override, last on each train/plan command")
    p.add_argument("--env-json", action="store_true", help=argparse.SUPPRESS)  # part 1's probe, in a process of its own
    args = p.parse_args(argv)
    if args.env_json:
        return env_json()
    if DS_OPTIMIZER not in ("auto", "fused", "torch"):
        p.error(f"DS_OPTIMIZER={DS_OPTIMIZER!r}: auto, fused or torch")
    OUT, t0, ctx = Path(args.out_dir).resolve(), time.monotonic(), Context(env={}, cuda=False, facts=set())
    if args.list:
        for c in CHECKS:
            needs = f" (needs {', '.join(sorted(c.needs))})" if c.needs else ""
            print(f"[{c.part}] {c.name}{needs}: {c.descr}; judge: {c.judge}")
            print(f"       $ {shlex.join(command(c, c.name, ctx, args.set))}" if c.argv else "       (no command)")
        print("{...}: known at run time: ds_extra (part 1), mb / ac / ac_tag (part 4's plan), gpu_kind / gpu_memory (the device)")
        return 0
    (OUT / "logs").mkdir(parents=True, exist_ok=True)
    (OUT / "results.jsonl").write_text("")
    RESULTS.clear()
    os.chdir(ROOT)  # relative paths in the runs (data.dir's cache) are the repository's, wherever this started
    print(f"gpu_checklist: results in {OUT}")
    for c in CHECKS:
        selected = not args.only or c.part == 1 or any(fnmatch(c.name, pattern) for pattern in args.only)
        if not selected or not c.needs <= ctx["facts"] | {"cuda" if ctx["cuda"] else "no-cuda"}:
            continue
        planned = ctx.get("mb")
        while run_check(c, ctx, args.set) and c.retry_oom and ctx["mb"] > 1:
            print(f"     out of memory at micro-batch {ctx['mb']}: once more at {ctx['mb'] // 2}")
            ctx["mb"] //= 2
        if planned:
            ctx["mb"] = planned  # each MFU run starts from the planned micro-batch
    if not ctx["cuda"]:
        report(4, "GPU parts (engines and planner on CUDA, 1b MFU)", "SKIP", "GPU parts skipped: no CUDA device", "", None)
    mode, wall = "GPU" if ctx["cuda"] else "CPU", round(time.monotonic() - t0)
    failed = sum(r["status"] == "FAIL" for r in RESULTS)
    summary(ctx["env"], mode, wall)
    print(f"summary: {OUT / 'summary.md'} ({mode} mode, {wall} s, {failed} failed)")
    print(f"FAIL: {failed} check(s) failed" if failed else "PASS: every check passed")
    return 1 if failed else 0


# ---------------------------------------------------------------- summary.md, and the environment probe


def summary(e: dict, mode: str, wall: int) -> None:
    rows = lambda part: [(r, r["data"]) for r in RESULTS if r["part"] == part and "data" in r]
    msec = lambda s: fmt(None if s is None else 1000 * s, "{:,.1f}")
    share = lambda v, step: "-" if v is None else f"{1000 * v:.1f} ({100 * v / step:.0f}%)" if step else f"{1000 * v:.1f}"
    md = [f"# scaletrain GPU checklist: {e.get('device_name') or 'CPU'} ({mode} mode)", ""]
    md.append(
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, host {e.get('host')}: scaletrain {e.get('scaletrain')}, "
        f"python {e.get('python')}, torch {e.get('torch')} (CUDA {e.get('torch_cuda')}, NCCL {e.get('nccl', '-')}), "
        f"deepspeed {e.get('deepspeed')}; device memory {size(e.get('device_memory'))}; "
        f"nvcc (for DeepSpeed's FusedAdam): {e.get('nvcc_release') or 'none'}. Wall time of the checklist: {wall} s."
    )
    # fmt: off
    tables = [  # title, columns, rows
        ("Checks", "part | check | result | detail",
         [(r["part"], r["name"], r["status"], r["detail"].replace("|", "/")) for r in RESULTS]),
        ("Engines (world size 1)", "run | engine | backend | first loss | last loss | tokens/s | peak memory | result",
         [(r["name"], d["engine"], d["backend"], fmt(d["first_loss"], "{:,.3f}"), fmt(d["last_loss"], "{:,.3f}"),
           fmt(d["tokens_per_s"]), size(d["mem_peak_bytes"]), r["status"]) for r, d in rows(2)]),
        ("Planner: predicted vs measured peak (`plan --measure`, 3 steps, this rank)",
         "config | strategy | predicted | measured (MemTracker) | error | CUDA max allocated | error | predicted peak phase",
         [(r["name"], d["strategy"], size(d["predicted"]), size(d["measured"]), pct(d["error"], "{:+.1f}%"),
           size(d["cuda_max_allocated"]), pct(d["error_cuda"], "{:+.1f}%"), d["peak_phase"]) for r, d in rows(3)]),
        ("MFU (median over the log intervals after the first)",
         "run | tokens/s | MFU | step (ms) | peak memory | peak FLOP/s (source) | result",
         [(r["name"], fmt(d["tokens_per_s"]), pct(d["mfu"]), msec(d["step_s"]), size(d["mem_peak_bytes"]),
           f"{d['peak_flops'] / 1e12:.3g} TFLOP/s ({d['peak_flops_source']})" if d["peak_flops"] else "-", r["status"])
          for r, d in rows(4)]),
        ("Where the time goes (ms per step; share of the step)",
         "run | data | forward | backward | optimizer | exposed comm | other | step",
         [(r["name"], *(share(d["phases"][k], d["step_s"]) for k in PHASES), msec(d["step_s"])) for r, d in rows(4)]),
    ]
    # fmt: on
    for title, columns, body in tables:
        if body:
            md += ["", f"## {title}", "", f"| {columns} |", "|" + "---|" * (columns.count("|") + 1)]
            md += [f"| {' | '.join(map(str, row))} |" for row in body]
    md += ["", "## Commands", "", *(f"- {r['name']}: `{r['cmd']}`" for r in RESULTS if r["cmd"])]
    (OUT / "summary.md").write_text("\n".join(md) + "\n")


def env_json() -> int:
    """Versions and the device as one JSON line (part 1 runs this in a process of its own)."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME  # where DeepSpeed looks for the nvcc that builds FusedAdam

    from scaletrain.distributed import versions  # python, torch, scaletrain, deepspeed: what run.json records

    cuda = torch.cuda
    info = {**versions(), "host": platform.node(), "torch_cuda": torch.version.cuda, "cuda_available": cuda.is_available()}
    if info["cuda_available"]:
        p = cuda.get_device_properties(0)
        info.update(device_count=cuda.device_count(), device_name=p.name, capability=f"{p.major}.{p.minor}")
        info.update(device_memory=p.total_memory, bf16=cuda.is_bf16_supported(), nccl=".".join(map(str, cuda.nccl.version())))
    nvcc = os.path.join(CUDA_HOME or "/nonexistent", "bin", "nvcc")
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # no nvcc, or a stub that cannot run: none
        out = subprocess.run([nvcc, "-V"], capture_output=True, text=True, timeout=60)
        if out.returncode == 0 and "release" in out.stdout:
            info.update(nvcc=nvcc, nvcc_release=out.stdout.split("release")[-1].split(",")[0].strip())
    print(json.dumps(info))
    return 0


OUT = Path("runs/gpu_checklist")  # set by main
RESULTS: list[dict] = []  # what results.jsonl holds, for summary.md

if __name__ == "__main__":
    sys.exit(main())
