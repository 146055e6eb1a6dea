"""The GPU checklist (docs/gpu.md): what scaletrain does on one NVIDIA GPU (H100/H200), in one go.

    .venv/bin/python scripts/gpu_checklist.py [OUT_DIR]   # OUT_DIR defaults to runs/gpu_checklist
    .venv/bin/python scripts/gpu_checklist.py --list      # every check, its command and expected time; runs nothing
    python3 scripts/gpu_checklist.py "$OUT" --work /tmp/gpucheck --budget 540   # the lent machine's command

CHECKS is the checklist, one entry per result line, in the manner of torchtitan's integration-test list,
in the order they run: 1 the environment, 2 each engine, 3 the 1b preset (eager, compiled, float8), 4 the
planner against measured peaks, 5 the checks other issues added (MORE_CHECKS), 6 what runs when time is
left. main's loop runs each entry with the test helpers (tests/helpers/launch.py); each result goes to
OUT_DIR/results.jsonl the moment it is known, and summary.md (the tables for docs/gpu.md) is rewritten
after it, so a run killed at its limit leaves both. With --budget, a check whose expected time
(gpu_checklist_times.py) no longer fits is skipped; later ones that fit still run. Without a CUDA
device (or with FORCE_CPU=1) parts 2 and 4 run as CPU stand-ins. Exit code 1 if a check failed, else 0.
Knobs (environment variables): STEP_TIMEOUT (seconds a command may run, 900), ENGINE_STEPS (3 on GPU,
10 on CPU), MFU_STEPS (20), MFU_MAX_MB (16), DS_OPTIMIZER (auto | fused | torch: see part 1),
KEEP_CHECKPOINTS=1 (keep each run's final checkpoint; a 1b one is ~15 GB), FORCE_CPU=1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
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
import tarfile
import time
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]  # also where a test loads this file from
import gpu_checklist_times as times  # noqa: E402  (this file's neighbour: the expected seconds per check)

from scaletrain.telemetry import read_metrics  # noqa: E402

from helpers import launch, runs  # noqa: E402  (how the tests start processes and kill them; what a run wrote)

knob = lambda name, default: int(os.environ.get(name) or default)
STEP_TIMEOUT, MFU_STEPS, MFU_MAX_MB = knob("STEP_TIMEOUT", 900), knob("MFU_STEPS", 20), knob("MFU_MAX_MB", 16)
GPU_STEPS, CPU_STEPS, FP16_STEPS = knob("ENGINE_STEPS", 3), knob("ENGINE_STEPS", 10), 10
DS_OPTIMIZER = os.environ.get("DS_OPTIMIZER", "auto")
KEEP_CHECKPOINTS, FORCE_CPU = os.environ.get("KEEP_CHECKPOINTS") == "1", os.environ.get("FORCE_CPU") == "1"
# A command's first word: this interpreter, so that the checklist runs the scaletrain it imports itself.
PROGRAMS = {"scaletrain": [sys.executable, "-m", "scaletrain"], "python": [sys.executable]}


@dataclass(frozen=True)
class Check:
    name: str  # unique; part 3's are templates of the micro-batch the planner allows ({mb}, {ac_tag})
    part: int
    descr: str
    argv: tuple[str, ...] = ()  # "scaletrain ..." or another program; (): judged from what earlier checks found
    judge: str = "first_line"  # the judge_* function that turns what it printed or wrote into PASS / FAIL / WARN
    needs: frozenset[str] = frozenset()  # "cuda" (GPU mode), "no-cuda" (the CPU stand-ins), or facts found before
    steps: int = 0  # > 0: a training run of this many steps, into WORK/runs/NAME
    retry_oom: bool = False  # out of memory: once more at half the micro-batch (the first attempt still fails)


CUDA, NO_CUDA = frozenset({"cuda"}), frozenset({"no-cuda"})
# ZeRO without offload: nothing, or torch's AdamW inside DeepSpeed where no nvcc can build FusedAdam (part 1).
DS = "{ds_extra}"
TORCH_ADAM = "parallel.deepspeed_extra={optimizer: {params: {torch_adam: true}}}"
# Part 2 on CUDA uses the small preset, a few steps, each logged: whether each engine trains on the GPU
# and its peak memory, not a speed figure (part 3 is). ddp at world 1 is one process without a group;
# fsdp and ZeRO make a group of one (NCCL on CUDA).
SMALL = ("model.preset=small", "run.device=cuda", "train.log_every=1")
ENGINES = {
    "ddp": ("parallel.strategy=ddp",),
    "fsdp": ("parallel.strategy=fsdp",),
    **{z: (f"parallel.strategy={z}", DS) for z in ("zero1", "zero2", "zero3")},
    # CPU offload: DeepSpeedCPUAdam (a C++ op built with the host compiler) and FSDP2's CPUOffloadPolicy.
    "zero3-offload": ("parallel.strategy=zero3", "parallel.offload_optimizer=cpu", "parallel.offload_params=cpu"),
    "fsdp-offload": ("parallel.strategy=fsdp", "parallel.offload_params=cpu"),
}
FIVE = ("ddp", "fsdp", "zero2", "zero3", "zero3-offload")  # part 2; zero1, fsdp-offload and fp16 in part 6
TINY = ("model.preset=tiny", "run.device=cpu", "precision=fp32")
PLAN_SMALL = ("model.preset=small", "data.seq_len=256", "train.micro_batch=8", "run.device=cuda")
# The 1b preset at its published vocabulary (Llama 3.2 1B, 1.24B parameters). A built-in preset takes
# the tokenizer's vocabulary (4096 here) unless model.vocab_size is set, while the planner has no
# tokenizer and plans 128256; a larger vocabulary than the tokenizer's is allowed (ids past 4096 never
# occur), so plan and run describe one model, comparable with published MFU figures.
BIG = ("model.preset=1b", "model.vocab_size=128256", "data.seq_len=2048", "precision=bf16")
BIG_CUDA = (*BIG, "run.device=cuda")
PLAN_1B = ("--gpus-per-node", "1", "--gpu", "{gpu_kind}", "--gpu-memory", "{gpu_memory}B", "--configured-only", "--json")
# Step 5 traced by torch.profiler (telemetry.profile_steps): the device time by kind of kernel and the idle
# device (judge_mfu), which say where the MFU goes. It is in the first log interval, which the medians leave out.
PROFILED_STEP = 5
MFU = (
    *BIG_CUDA,
    "parallel.strategy=fsdp",
    "train.micro_batch={mb}",
    "train.log_every=5",
    f"telemetry.profile_steps=[{PROFILED_STEP},{PROFILED_STEP}]",
)
AC = "parallel.activation_checkpointing"
MOE_V3 = "model.moe={{experts: 64, top_k: 8, groups: 8, topk_groups: 4, score: sigmoid, balance: bias}}"
# Part 4 (the first four) and part 6: three real steps under torch's MemTracker (on CUDA also
# max_memory_allocated). The error is reported, not judged: FAIL only when the command fails; beyond 15%
# (the CPU tests' bound) is marked. The 1b ones first; then zero2, whose buckets the planner models apart.
PLANNER = {
    "1b-fsdp-bf16-AC-mb4": (*BIG_CUDA, "parallel.strategy=fsdp", f"{AC}=true", "train.micro_batch=4"),
    "1b-fsdp-bf16-mb2": (*BIG_CUDA, "parallel.strategy=fsdp", "train.micro_batch=2"),
    "1b-zero3-bf16-AC-mb4": (*BIG_CUDA, "parallel.strategy=zero3", f"{AC}=true", "train.micro_batch=4", DS),
    "small-zero2-bf16": (*PLAN_SMALL, "parallel.strategy=zero2", "precision=bf16", DS),
    "small-ddp-fp32": (*PLAN_SMALL, "parallel.strategy=ddp", "precision=fp32"),
    "small-fsdp-bf16": (*PLAN_SMALL, "parallel.strategy=fsdp", "precision=bf16"),
    "small-zero3-bf16": (*PLAN_SMALL, "parallel.strategy=zero3", "precision=bf16", DS),
}
engine_check = lambda e, p, part, steps=GPU_STEPS: Check(
    f"{e}-{p}", part, f"{e} trains in {p} on CUDA", ("scaletrain", "train", *SMALL, *ENGINES[e], f"precision={p}"), "trains",
    CUDA, steps)  # fmt: skip
planner_check = lambda n, part: Check(n, part, "the planner's peak against a measured one",
                                ("scaletrain", "plan", *PLANNER[n], "--measure", "--json"), "measure", CUDA)  # fmt: skip

# Part 5: the checks other issues add, on CUDA, after the ones above. Append here: a Check with part 5,
# needs=CUDA, a judge (judge_trains for a run: steps=GPU_STEPS keeps it short), and its expected seconds
# in gpu_checklist_times.GPU_S (else UNKNOWN_S is planned); --list shows where it falls in the budget.
# fmt: off
MORE_CHECKS = [
    # The planner's clock (issue 55): this GPU's table (matmuls at the presets' shapes, attention by
    # length and head size, bandwidth, the host's cost per operation: scaletrain plan --calibrate, about a
    # minute), kept in OUT as clock-table-<kind>.json to commit; then every run recorded under docs/gpu/
    # predicted with it (scaletrain bench --suite clock-gpu), the table in OUT as clock-gpu.md.
    Check("clock-calibrate", 5, "the clock's rates on this GPU (its table)", ("scaletrain", "plan", "--calibrate"),
          "calibrate", CUDA),
    Check("clock-gpu", 5, "every run under docs/gpu/ predicted with this GPU's table against its measured step",
          ("scaletrain", "bench", "--suite", "clock-gpu", "--out", str(ROOT / "docs" / "gpu"), "--json"), "clock_gpu", CUDA),
    # A mixture of experts (issue 27): on CUDA in bf16 its experts run as one torch._grouped_mm; the
    # small preset with 8 experts, top-2 (model.moe={}); its MFU counts the active experts only. With the
    # host reads inside a step counted for real (issue 38, docs/gpu.md "Host reads": torch's CUDA sync debug
    # mode besides the Python calls), two intervals of 2: the steady one's count and sites go into
    # results.jsonl; WARN, not FAIL, on a read (a finding the CPU's count could not see).
    Check("moe-small-bf16", 5, "a mixture of experts trains in bf16 on CUDA (the grouped matmul), no host sync in a step",
          ("scaletrain", "train", *SMALL, "model.moe={{}}", "parallel.strategy=fsdp", "precision=bf16",
           "telemetry.host_syncs=true", "train.log_every=2"), "host_syncs", CUDA, 4),
    # Document masking (issue 28): on CUDA the attention is FlexAttention's compiled block-mask kernel.
    Check("document-mask-bf16", 5, "data.document_mask trains in bf16 on CUDA (FlexAttention's block mask)",
          ("scaletrain", "train", *SMALL, "data.document_mask=true", "parallel.strategy=fsdp", "precision=bf16"), "trains",
          CUDA, GPU_STEPS),
    # Context parallel (issue 29): each chunk's queries on the flash and cuDNN kernels (causal_lower_right)
    # equal full causal attention's rows in bf16 (scripts/cp_kernels.py; one JSON line per backend and cp).
    Check("cp-attention-kernels", 5, "context parallel's chunk attention on flash and cuDNN equals full causal rows",
          ("python", str(Path(__file__).resolve().parent / "cp_kernels.py")), "first_line", CUDA),
    # A real out-of-memory error (issue 26): micro-batch 64 of the 1b preset cannot fit; one process retries
    # in place at half the micro-batch (same global batch) until it does, and trains.
    Check("oom-1b-mb64", 5, "a real out-of-memory error survived: micro-batch 64 halved until it fits",
          ("scaletrain", "train", *BIG_CUDA, "parallel.strategy=fsdp", "train.global_batch=64", "train.micro_batch=64"),
          "trains", CUDA, GPU_STEPS),
    # DeepSeek-V3's routing at a width a GPU holds (issue 40): the small preset with 64 experts, top-8,
    # sigmoid scores, 8 groups of which each token takes 4, the loss-free bias; tokens/s of the experts as
    # one grouped matmul against one matmul per expert (the loop, which reads the counts on the host).
    *(Check(f"moe-v3-{impl}-bf16", 5, f"DeepSeek-V3 routing (64 experts, top-8, 4 of 8 groups, bias), experts {impl}",
            ("scaletrain", "train", *SMALL, MOE_V3, f"model.moe.experts_impl={impl}", "parallel.strategy=fsdp",
             "precision=bf16", "train.log_every=5"), "trains", CUDA, 10)
      for impl in ("grouped", "loop")),
    # Long sequences (issue 42): the 1b preset at 32k tokens, micro-batch 1, activation checkpointing; then
    # the same with the blocks' inputs held in pinned host memory (train.activation_offload) and the
    # feed-forward in tiles of 4096 (train.tile_tokens). Both train; their rows hold the peak memory,
    # tokens/s and (offload) the bytes each step held on the host: what offload and tiles save and cost.
    *(Check(f"long-1b-32k-{name}", 5, f"the 1b preset at 32k tokens with activation checkpointing{what}",
            ("scaletrain", "train", *BIG_CUDA, "data.seq_len=32768", "parallel.strategy=fsdp", f"{AC}=true",
             "train.micro_batch=1", "train.log_every=5", *flags), "trains", CUDA, 10)
      for name, what, flags in (("AC", "", ()),
                                ("AC-host-tiles", ", offload and tiles",
                                 ("train.activation_offload=true", "train.tile_tokens=4096")))),
]

# A table, one check or one generated family of checks per entry, laid out by hand, in the order they run.
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
    *(engine_check(e, "bf16", 2) for e in FIVE),
    *(Check(f"{e}-cpu", 2, f"{e} trains on CPU (stand-in)", ("scaletrain", "train", *TINY, "train.log_every=5", *o),
            "trains", NO_CUDA, CPU_STEPS)
      for e, o in {"ddp": ("parallel.strategy=ddp",), "fsdp": ("parallel.strategy=fsdp",),
                   # DeepSpeed's default bucket (5e7 elements) made a tiny zero2 step 4.4 s on 2 cores, not 0.25 s.
                   "zero2": ("parallel.strategy=zero2", "parallel.bucket_size=2000000")}.items()),
    # Part 3: the largest micro-batch the planner says fits this device (its memory as torch reports it),
    # then 20 steps each: eager (the defaults), compiled, float8 (torchao) compiled.
    *(Check(f"plan 1b AC={ac}", 3, "the largest micro-batch that fits",
            ("scaletrain", "plan", *BIG, "parallel.strategy=fsdp", f"{AC}={ac}", "train.micro_batch=1", *PLAN_1B),
            "plan_mb", CUDA) for ac in ("false", "true")),
    Check("MFU 1b", 3, "the runs' micro-batch: the largest power of two within the plan and MFU_MAX_MB; activation "
          "checkpointing (a recompute of each block) only where nothing fits without", judge="micro_batch",
          needs=CUDA | {"planned"}),
    *(Check(f"1b-{how}-mb{{mb}}{{ac_tag}}", 3, f"MFU, {how.replace('-', ', ')}",
            ("scaletrain", "train", *MFU, f"{AC}={{ac}}", *flags), "mfu", CUDA | {"micro-batch"}, MFU_STEPS,
            retry_oom=True)
      for how, flags in {"eager": ("train.compile=false",), "compiled": ("train.compile=true",),
                         "float8-compiled": ("train.compile=true", "train.float8=true")}.items()),
    *(planner_check(n, 4) for n in list(PLANNER)[:4]),
    # One torch engine and one DeepSpeed engine; on a CPU mostly start-up.
    *(Check(f"tiny-{s}-cpu", 4, "the planner's peak against a measured one on CPU (stand-in)",
            ("scaletrain", "plan", *TINY, f"parallel.strategy={s}", "--measure", "--json"), "measure", NO_CUDA)
      for s in ("ddp", "zero2")),
    *MORE_CHECKS,
    # Part 6, when time is left (always, without --budget): the rest of the engines, what activation
    # checkpointing costs, the other planner configurations, and fp16 (10 steps: its loss scale may skip
    # the first ones).
    engine_check("zero1", "bf16", 6), engine_check("fsdp-offload", "bf16", 6),
    Check("1b-eager-mb{mb}-AC", 6, "what activation checkpointing costs, where the runs above went without",
          ("scaletrain", "train", *MFU, f"{AC}=true", "train.compile=false"), "mfu",
          CUDA | {"micro-batch", "no-ac-needed"}, MFU_STEPS, retry_oom=True),
    *(planner_check(n, 6) for n in list(PLANNER)[4:]),
    *(engine_check(e, "fp16", 6, FP16_STEPS) for e in FIVE),
]
# fmt: on
PHASES = ("data_s", "forward_s", "backward_s", "optimizer_s", "comm_s", "other_s")
# The kinds of kernel summary.md gives a column each (telemetry/profile.py's KERNEL_KINDS), the rest as "other".
KINDS = (
    "matmul",
    "attention",
    "fused (inductor)",
    "elementwise, reductions (aten)",
    "optimizer",
    "copies",
    "communication",
    "other",
)


class Context(dict):  # what earlier checks found (env, facts, ds_extra, mb, ...)
    __missing__ = lambda self, key: "{" + key + "}"  # a template key not known yet stays as it is


def command(c: Check, name: str, ctx: Context, extra: list[str]) -> list[str]:
    words = [v for w in c.argv for v in (ctx.get("ds_extra", [w]) if w == DS else [w.format_map(ctx)])]
    if c.steps:  # train.resume=never: a rerun into the same WORK must not resume the last one and train zero steps
        words += [f"train.steps={c.steps}", "checkpoint.every=0", "train.resume=never", f"run.dir={WORK / 'runs' / name}"]
    if words[1:2] in (["train"], ["plan"]):  # --set: after the other overrides, so that it wins
        at = max((i for i, w in enumerate(words) if "=" in w and not w.startswith("-")), default=1) + 1
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
    steps = runs.metric_rows(run_dir)  # which asserts one row per step, in order
    losses = [r["loss"] for r in steps] or [math.nan]  # no rows: "not finite", and steps are missing
    intervals = [r for r in read_metrics(run_dir / "metrics.jsonl", events=True) if r.get("event") == "interval"]
    steady = intervals[1:] or intervals  # the first interval holds start-up (allocator warm-up, compilation)
    d = {k: runs.run_info(run_dir).get(k) for k in ("engine", "backend", "device", "peak_flops", "peak_flops_source")}
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


def judge_mfu(proc, ctx):
    """As judge_trains, then the profiled step's device time by kind of kernel (telemetry/profile.py's
    analyze_trace): its share of the step for each kind and for the idle device, the costliest kernels."""
    from scaletrain.telemetry.profile import analyze_trace

    status, detail, d = judge_trains(proc, ctx)
    trace = Path(overrides(proc)["run.dir"]) / "profile" / "rank0.trace.json"
    if not trace.is_file():
        return "FAIL", f"no trace of step {PROFILED_STEP} ({trace}); {detail}", d
    a = analyze_trace(trace)
    d["profile"] = {k: a.get(k) for k in ("total_s", "kernel_s", "gpu_idle_s", "top_kernels")}
    step, kinds = a["total_s"], {**(a.get("kernel_s") or {}), "idle": a.get("gpu_idle_s")}
    top = sorted(((k, v) for k, v in kinds.items() if v), key=lambda kv: -kv[1])[:4]
    return status, f"{detail}; step {PROFILED_STEP}: " + ", ".join(f"{k} {pct(v / step, '{:.0f}%')}" for k, v in top), d


def judge_host_syncs(proc, ctx):
    """As judge_trains, then the last interval's host reads: WARN with their sites when a step made any."""
    status, detail, d = judge_trains(proc, ctx)
    run_dir = Path(overrides(proc)["run.dir"])
    intervals = [r for r in read_metrics(run_dir / "metrics.jsonl", events=True) if r.get("event") == "interval"]
    counted = intervals[-1].get("host_syncs") if intervals else None
    d["host_syncs"] = counted
    if counted is None:
        return "FAIL", f"no host_syncs in the interval rows; {detail}", d
    line = f"{counted['step']} reads in {intervals[-1]['steps']} steps, {counted['flush']} at the flush: {counted['sites']}"
    if status == "PASS" and counted["step"]:
        status = "WARN"
    return status, f"{line}; {detail}", d


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
    ctx["facts"].add("planned")  # not where the plans failed or were skipped for the budget
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


def judge_calibrate(proc, ctx):
    """The table `scaletrain plan --calibrate` wrote (its last line names it), copied into OUT."""
    where = json.loads(proc.stdout.strip().splitlines()[-1])
    table = json.loads(Path(where["path"]).read_text())
    shutil.copy(where["path"], OUT / f"clock-table-{where['kind']}.json")
    mm = [row[-1] for row in table["matmul"].get("bfloat16", [])]
    detail = (
        f"{where['kind']}: {len(mm)} matmul shapes in bf16 at {min(mm) / 1e12:.0f}-{max(mm) / 1e12:.0f} TFLOP/s, "
        f"memory {table['memory_bytes_per_s'] / 1e12:.2f} TB/s, host {table['host_op_s'] * 1e6:.1f} us per operation"
    )
    return (
        "PASS",
        detail,
        {"kind": where["kind"], "host_op_s": table["host_op_s"], "memory_bytes_per_s": table["memory_bytes_per_s"]},
    )


def judge_clock_gpu(proc, ctx):
    """Each recorded run predicted with this GPU's table: the table (clock-gpu.md) and how many within 15%."""
    rows = json.loads(proc.stdout[proc.stdout.index("[") :])
    lines = ["| run | measured s | predicted s | error |", "|---|---|---|---|"]
    lines += [
        f"| {r['name']} ({r['where']}) | {r['measured_s']:.4g} | {r['predicted_s']:.4g} | {r['error']:+.1%} |" for r in rows
    ]
    (OUT / "clock-gpu.md").write_text("\n".join(lines) + "\n")
    within = sum(abs(r["error"]) <= 0.15 for r in rows)
    errors = sorted(abs(r["error"]) for r in rows)
    detail = f"{within} of {len(rows)} runs within 15%, median |error| {errors[len(errors) // 2]:.1%}, largest {errors[-1]:.1%}"
    return ("PASS" if within == len(rows) else "WARN"), detail, {"within_15": within, "runs": len(rows)}


JUDGES = {name.removeprefix("judge_"): f for name, f in list(globals().items()) if name.startswith("judge_")}


# ---------------------------------------------------------------- the driver


def run_check(c: Check, ctx: Context, extra: list[str], deadline: float) -> bool:
    """Run one check, print its line and record it; returns whether it failed out of memory."""
    name = c.name.format_map(ctx)
    argv, t0, proc, status, data = command(c, name, ctx, extra), time.monotonic(), None, "FAIL", None
    log = WORK / "logs" / (re.sub(r"[^\w.=-]+", "-", name) + ".log")
    if argv and not shutil.which(argv[0]):
        report(c, name, "SKIP", f"{argv[0]} not found", "", None, ctx)
        return False
    if c.steps:
        shutil.rmtree(WORK / "runs" / name, ignore_errors=True)
    # Killed at STEP_TIMEOUT, or where the budget ends (what is left of it at the end stays for the summary).
    timeout, why = min((STEP_TIMEOUT, "STEP_TIMEOUT"), (deadline - time.monotonic() - times.RESERVE_S, "the budget's end"))
    # A session of its own, output to files. one_thread=False: the helpers' default suits tests run two at a time.
    launched = launch.Launched(argv, one_thread=False) if argv else None
    try:
        proc = launched.wait(timeout) if launched else None
        if proc:
            log.write_text(proc.stdout + proc.stderr)
        if proc and proc.returncode:
            detail = f"exit {proc.returncode}, log {log}"
        else:
            status, detail, data = JUDGES[c.judge](proc, ctx)
    except Exception as e:  # the helpers' timeout (they killed the whole tree), or output that cannot be read
        detail = f"{type(e).__name__}: {e}".splitlines()[0]
        if launched and proc is None:  # what it wrote until then stays in the helpers' files
            detail = f"killed after {max(timeout, 1):.0f} s ({why}), log {log}"
            text = launched._read(launched._out) + launched._read(launched._err)
            log.write_text(f"{text}\ngpu_checklist: killed after {max(timeout, 1):.0f} s ({why})\n")
    if c.steps and not KEEP_CHECKPOINTS:
        shutil.rmtree(WORK / "runs" / name / "checkpoints", ignore_errors=True)
    seconds = time.monotonic() - t0
    report(c, name, status, detail + (f" ({seconds:.0f} s)" if argv else ""), shlex.join(argv), data, ctx, seconds)
    text = log.read_text(errors="replace") if argv and log.exists() else ""
    if status == "FAIL" and text:
        print("\n".join(f"       | {ln}" for ln in text.splitlines()[-15:]))
    return status == "FAIL" and bool(re.search(r"out of memory|OutOfMemoryError", text, re.IGNORECASE))


def report(c, name, status, detail, cmd, data, ctx, seconds=None):
    """One result: its line printed, appended to results.jsonl at once, and summary.md (and the logs'
    tarball, where they are kept apart) rewritten, so that a run killed at any point leaves what it did."""
    print(f"{status:<4} [{c.part}] {name}: {detail}" + (f"\n       $ {cmd}" if cmd else ""), flush=True)
    row = dict(part=c.part, name=name, status=status, detail=detail, cmd=cmd)
    row.update({"check": c.name} if c.name != name else {}, **({} if seconds is None else {"seconds": round(seconds, 1)}))
    RESULTS.append({**row, **({"data": data} if data else {})})
    with open(OUT / "results.jsonl", "a") as f:
        f.write(json.dumps(RESULTS[-1]) + "\n")
    summary(ctx)
    if WORK != OUT:
        pack_logs()


def pack_logs() -> None:
    """OUT_DIR/logs.tar.gz: every log, and each run's metrics, run.json and config (not its checkpoints)."""
    tmp = OUT / "logs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted((WORK / "logs").glob("*.log")):
            tar.add(f, f"logs/{f.name}")
        for f in sorted(p for n in ("metrics.jsonl", "run.json", "config.yaml") for p in (WORK / "runs").glob(f"*/{n}")):
            tar.add(f, f"runs/{f.parent.name}/{f.name}")
    tmp.replace(OUT / "logs.tar.gz")  # whole, or the one before


def list_checks(ctx: Context, extra: list[str], budget: float) -> None:
    """Every check in order with its command and expected seconds; where a budget of this size cuts."""
    used = total = 0.0
    cut = False
    print(
        f"Expected seconds: {times.SOURCE} for GPU mode (scripts/gpu_checklist_times.py, plus {times.OVERHEAD_S:g} s "
        f"of the checklist's own per check); where --budget {budget:.0f} cuts, with {times.RESERVE_S:.0f} s kept for the end"
    )
    for c in CHECKS:
        needs = f" (needs {', '.join(sorted(c.needs))})" if c.needs else ""
        cpu = "no-cuda" in c.needs
        s = times.expected(c.name, not cpu)
        when = f"~{s:.0f} s, {times.label(c.name, not cpu)}"
        if cpu:
            when += ", CPU mode only"
        else:
            total += s
            fits = used + s <= budget - times.RESERVE_S
            used += s if fits else 0
            if not fits and not cut:
                print(f"------ a {budget:.0f} s budget (--budget {budget:.0f}) cuts here: a check that no longer fits is skipped"
                      ", a later one that fits still runs")  # fmt: skip
            cut |= not fits
            when += f", {total:.0f} s in all" + ("" if fits else f": skipped under --budget {budget:.0f}")
        print(f"[{c.part}] {c.name}{needs}: {c.descr}; judge: {c.judge}; {when}")
        print(f"       $ {shlex.join(command(c, c.name, ctx, extra))}" if c.argv else "       (no command)")
    print("{...}: known at run time: ds_extra (part 1), mb / ac / ac_tag (part 3's plan), gpu_kind / gpu_memory (the device)")
    print(f"GPU mode: {total:.0f} s expected for every check; {used:.0f} s of them run under --budget {budget:.0f}")


def main(argv: list[str] | None = None) -> int:
    global OUT, WORK
    p = argparse.ArgumentParser(epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", nargs="?", default="runs/gpu_checklist", help="where the results are written")
    p.add_argument("--work", metavar="DIR", help="where logs/ and runs/ go (default OUT_DIR); then OUT_DIR gets logs.tar.gz")
    p.add_argument("--budget", type=float, metavar="SECONDS", help="skip each check whose expected time no longer fits")
    p.add_argument("--list", action="store_true", help="print every check with its command and expected time, run nothing")
    p.add_argument("--only", action="append", metavar="PATTERN", help="of parts 2-6, only the checks so named (fnmatch)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override, last on each train/plan command")
    p.add_argument("--env-json", action="store_true", help=argparse.SUPPRESS)  # part 1's probe, in a process of its own
    args = p.parse_args(argv)
    if args.env_json:
        return env_json()
    if DS_OPTIMIZER not in ("auto", "fused", "torch"):
        p.error(f"DS_OPTIMIZER={DS_OPTIMIZER!r}: auto, fused or torch")
    if args.budget is not None and args.budget <= 0:
        p.error(f"--budget {args.budget:g}: a number of seconds above 0")
    OUT, t0, ctx = Path(args.out_dir).resolve(), time.monotonic(), Context(env={}, cuda=False, facts=set())
    WORK = Path(args.work).resolve() if args.work else OUT
    if args.list:
        list_checks(ctx, args.set, args.budget or 540)
        return 0
    (WORK / "logs").mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.jsonl").write_text("")
    RESULTS.clear()
    ctx["t0"], deadline = t0, t0 + (args.budget or math.inf)
    os.chdir(ROOT)  # relative paths in the runs (data.dir's cache) are the repository's, wherever this started
    print(f"gpu_checklist: results in {OUT}" + (f", logs and runs in {WORK}" if WORK != OUT else ""))
    for c in CHECKS:
        selected = not args.only or c.part == 1 or any(fnmatch(c.name, pattern) for pattern in args.only)
        if not selected or not c.needs <= ctx["facts"] | {"cuda" if ctx["cuda"] else "no-cuda"}:
            continue
        planned = ctx.get("mb")
        while True:
            need, left = times.expected(c.name, ctx["cuda"]), deadline - time.monotonic() - times.RESERVE_S
            if need > left:  # a later, shorter check may still fit
                why = f"budget: expects ~{need:.0f} s ({times.label(c.name, ctx['cuda'])}), {max(left, 0):.0f} s left"
                cmd = shlex.join(command(c, c.name.format_map(ctx), ctx, args.set))  # what would have run
                report(c, c.name.format_map(ctx), "SKIP", f"{why} of --budget {args.budget:g}", cmd, None, ctx)
                break
            if not (run_check(c, ctx, args.set, deadline) and c.retry_oom and ctx["mb"] > 1):
                break
            print(f"     out of memory at micro-batch {ctx['mb']}: once more at {ctx['mb'] // 2}")
            ctx["mb"] //= 2
        if planned:
            ctx["mb"] = planned  # each MFU run starts from the planned micro-batch
    if not ctx["cuda"]:
        report(Check(GPU_SKIPPED, 4, ""), GPU_SKIPPED, "SKIP", "GPU parts skipped: no CUDA device", "", None, ctx)
    mode, wall, ctx["done"] = "GPU" if ctx["cuda"] else "CPU", round(time.monotonic() - t0), True
    failed = sum(r["status"] == "FAIL" for r in RESULTS)
    summary(ctx)
    print(f"summary: {OUT / 'summary.md'} ({mode} mode, {wall} s, {failed} failed)")
    print(f"FAIL: {failed} check(s) failed" if failed else "PASS: every check passed")
    return 1 if failed else 0


# ---------------------------------------------------------------- summary.md, and the environment probe


def summary(ctx: Context) -> None:
    """OUT_DIR/summary.md from the results so far: rewritten after each check."""
    e, mode, wall = ctx["env"], "GPU" if ctx["cuda"] else "CPU", round(time.monotonic() - ctx["t0"])
    mfu = lambda r: r["name"].startswith("1b-")  # the 1b runs of part 3 (and part 6's with activation checkpointing)
    rows = lambda want: [(r, r["data"]) for r in RESULTS if "data" in r and want(r)]
    runs = lambda r: "first_loss" in r["data"]  # what judge_trains read
    msec = lambda s: fmt(None if s is None else 1000 * s, "{:,.1f}")
    share = lambda v, step: "-" if v is None else f"{1000 * v:.1f} ({100 * v / step:.0f}%)" if step else f"{1000 * v:.1f}"
    md = [f"# scaletrain GPU checklist: {e.get('device_name') or 'CPU'} ({mode} mode)", ""]
    md.append(
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, host {e.get('host')}: scaletrain {e.get('scaletrain')}, "
        f"python {e.get('python')}, torch {e.get('torch')} (CUDA {e.get('torch_cuda')}, NCCL {e.get('nccl', '-')}), "
        f"deepspeed {e.get('deepspeed')}, torchao {e.get('torchao')}, triton {e.get('triton')}; "
        f"device memory {size(e.get('device_memory'))}; "
        f"nvcc (for DeepSpeed's FusedAdam): {e.get('nvcc_release') or 'none'}. Wall time of the checklist: {wall} s"
        f"{'' if ctx.get('done') else ' so far (still running, or stopped)'}."
    )
    # fmt: off
    tables = [  # title, columns, rows
        ("Checks", "part | check | result | detail",
         [(r["part"], r["name"], r["status"], r["detail"].replace("|", "/")) for r in RESULTS]),
        ("Engines (world size 1)", "run | engine | backend | first loss | last loss | tokens/s | peak memory | result",
         [(r["name"], d["engine"], d["backend"], fmt(d["first_loss"], "{:,.3f}"), fmt(d["last_loss"], "{:,.3f}"),
           fmt(d["tokens_per_s"]), size(d["mem_peak_bytes"]), r["status"])
          for r, d in rows(lambda r: runs(r) and not mfu(r))]),
        ("Planner: predicted vs measured peak (`plan --measure`, 3 steps, this rank)",
         "config | strategy | predicted | measured (MemTracker) | error | CUDA max allocated | error | predicted peak phase",
         [(r["name"], d["strategy"], size(d["predicted"]), size(d["measured"]), pct(d["error"], "{:+.1f}%"),
           size(d["cuda_max_allocated"]), pct(d["error_cuda"], "{:+.1f}%"), d["peak_phase"])
          for r, d in rows(lambda r: "predicted" in r["data"])]),
        ("MFU (median over the log intervals after the first)",
         "run | tokens/s | MFU | step (ms) | peak memory | peak FLOP/s (source) | result",
         [(r["name"], fmt(d["tokens_per_s"]), pct(d["mfu"]), msec(d["step_s"]), size(d["mem_peak_bytes"]),
           f"{d['peak_flops'] / 1e12:.3g} TFLOP/s ({d['peak_flops_source']})" if d["peak_flops"] else "-", r["status"])
          for r, d in rows(lambda r: runs(r) and mfu(r))]),
        ("Where the time goes (ms per step; share of the step)",
         "run | data | forward | backward | optimizer | exposed comm | other | step",
         [(r["name"], *(share(d["phases"][k], d["step_s"]) for k in PHASES), msec(d["step_s"]))
          for r, d in rows(lambda r: runs(r) and mfu(r))]),
        (f"Device time by kind of kernel (ms in step {PROFILED_STEP}, traced; share of that step)",
         f"run | {' | '.join(KINDS)} | idle device | step",
         [(r["name"], *(share((p["kernel_s"] or {}).get(k), p["total_s"]) for k in KINDS[:-1]),
           share(sum(v for k, v in (p["kernel_s"] or {}).items() if k not in KINDS[:-1]) or None, p["total_s"]),
           share(p["gpu_idle_s"], p["total_s"]), msec(p["total_s"]))
          for r, d in rows(lambda r: bool(r["data"].get("profile"))) if (p := d["profile"])]),
        ("Costliest kernels of the traced step (name cut at 90 characters)", "run | kernel | ms | calls",
         [(r["name"], k["name"][:90].replace("|", "/"), msec(k["self_s"]), k["count"])
          for r, d in rows(lambda r: bool(r["data"].get("profile"))) for k in d["profile"]["top_kernels"][:5]]),
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

    import scaletrain
    from scaletrain.launch.distributed import versions  # python, torch, scaletrain, deepspeed: what run.json records

    cuda = torch.cuda
    info = {**versions(), "host": platform.node(), "torch_cuda": torch.version.cuda, "cuda_available": cuda.is_available()}
    info["torch_cuda_arch_list"] = os.environ.get(
        "TORCH_CUDA_ARCH_LIST"
    )  # as the image sets it: DeepSpeed's ops build for it (launch/env.py)
    info["scaletrain"] = info["scaletrain"] or f"{scaletrain.__version__} (source: {Path(scaletrain.__file__).parent})"
    for package in ("torchao", "triton", "pydantic"):  # float8's, compile's, the config's
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info[package] = importlib.metadata.version(package)
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


OUT = WORK = Path("runs/gpu_checklist")  # set by main: the results; the logs and runs
GPU_SKIPPED = "GPU parts (engines and planner on CUDA, 1b MFU)"  # the line CPU mode ends with
RESULTS: list[dict] = []  # what results.jsonl holds, for summary.md

if __name__ == "__main__":
    sys.exit(main())
