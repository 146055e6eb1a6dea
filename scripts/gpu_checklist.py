"""What scripts/gpu_checklist.sh reads and writes: the runs' metrics.jsonl, run.json and
`plan --measure`'s JSON in, results.jsonl and summary.md out. Standard library only, plus
torch for `env`. Called as `python scripts/gpu_checklist.py ACTION ARGS...`."""

import importlib.metadata
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

GiB, MiB = 2**30, 2**20


def size(b):
    if b is None:
        return "-"
    return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / MiB:.1f} MiB"


def num(x, digits=0):
    return "-" if x is None else f"{x:,.{digits}f}"


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def signed(x):
    return "-" if x is None else f"{100 * x:+.1f}%"


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def env():
    """Versions and the device, as one JSON line."""
    info = {"python": platform.python_version(), "executable": sys.executable, "host": platform.node()}
    for pkg in ("scaletrain", "deepspeed"):
        try:
            info[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            info[pkg] = None
    try:
        import torch
    except Exception as e:  # the check says what is missing
        info["error"] = f"import torch failed: {e}"
        print(json.dumps(info))
        return 1
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if info["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        info.update(
            device_count=torch.cuda.device_count(),
            device_name=p.name,
            capability=f"{p.major}.{p.minor}",
            device_memory=p.total_memory,
            bf16=torch.cuda.is_bf16_supported(),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    # DeepSpeed JIT-compiles FusedAdam (its optimizer on GPU without offload) with
    # CUDA_HOME/bin/nvcc, CUDA_HOME as torch finds it; a stub that cannot run counts as none.
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:
        CUDA_HOME = None
    info["cuda_home"] = CUDA_HOME
    info["nvcc"] = None
    if CUDA_HOME:
        nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
        try:
            out = subprocess.run([nvcc, "-V"], capture_output=True, text=True, timeout=60)
            if out.returncode == 0 and "release" in out.stdout:
                info["nvcc"] = nvcc
                info["nvcc_release"] = out.stdout.split("release")[-1].split(",")[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    info["ninja"] = shutil.which("ninja") or (
        os.path.join(sys.prefix, "bin", "ninja") if os.path.exists(os.path.join(sys.prefix, "bin", "ninja")) else None
    )
    print(json.dumps(info))
    return 0


def get(path, key):
    """One field of a JSON file (env.json), printed for the shell; empty when absent."""
    with open(path) as f:
        value = json.load(f).get(key)
    print("" if value is None else (str(value).lower() if isinstance(value, bool) else value))
    return 0


def metrics(run_dir, expect_steps, out):
    """Summarise a run: losses, throughput, MFU, memory, phases. Exit 1 (with the reason
    on stdout) when the loss is not finite, did not fall, or steps are missing."""
    rows = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        print(f"no {path}")
        return 1
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))  # json reads NaN / Infinity as floats
    steps = [r for r in rows if "event" not in r and "loss" in r]
    intervals = [r for r in rows if r.get("event") == "interval"]
    run = {}
    if os.path.exists(os.path.join(run_dir, "run.json")):
        with open(os.path.join(run_dir, "run.json")) as f:
            run = json.load(f)
    # The first interval holds start-up (allocator warm-up, compilation): left out when
    # there are others.
    steady = intervals[1:] if len(intervals) > 1 else intervals
    losses = [r["loss"] for r in steps]
    s = {
        "steps": len(steps),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "skipped": sum(1 for r in steps if r.get("skipped")),
        "tokens_per_s": median(r.get("tokens_per_s") for r in steady),
        "mfu": median(r.get("mfu") for r in steady),
        "step_s": median(r.get("step_s") for r in steady),
        "mem_peak_bytes": max((r.get("mem_peak_bytes") or 0 for r in intervals), default=None),
        "phases": {
            k: median((r.get("phases") or {}).get(k) for r in steady)
            for k in ("data_s", "forward_s", "backward_s", "optimizer_s", "comm_s", "other_s")
        },
        "intervals": len(intervals),
        "engine": run.get("engine"),
        "backend": run.get("backend"),
        "device": run.get("device"),
        "device_name": run.get("device_name"),
        "peak_flops": run.get("peak_flops"),
        "peak_flops_source": run.get("peak_flops_source"),
        "flops_per_token": run.get("flops_per_token"),
    }
    problems = []
    if not losses:
        problems.append("no loss rows")
    elif not all(math.isfinite(v) for v in losses):
        problems.append("a loss is not finite")
    elif not s["last_loss"] < s["first_loss"]:
        problems.append(f"loss did not fall ({s['first_loss']:.4f} -> {s['last_loss']:.4f})")
    if len(steps) < int(expect_steps):
        problems.append(f"{len(steps)} of {expect_steps} steps")
    s["problems"] = problems
    with open(out, "w") as f:
        json.dump(s, f)
    line = (
        f"loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}, {num(s['tokens_per_s'])} tok/s, "
        f"MFU {pct(s['mfu'])}, peak {size(s['mem_peak_bytes'])}"
        if losses
        else "no losses"
    )
    if s["skipped"]:
        line += f", {s['skipped']} fp16 steps skipped"
    print("; ".join(problems + [line]) if problems else line)
    return 1 if problems else 0


def measure(log, out):
    """The last JSON object --measure printed: predicted vs measured peak."""
    found = None
    with open(log, errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{") and '"predicted"' in line:
                try:
                    found = json.loads(line)
                except ValueError:
                    pass
    if found is None:
        print("no --measure JSON in the output")
        return 1
    p, m = found["predicted"], found["measured"]
    s = {
        "strategy": found["strategy"],
        "world": found["world"],
        "predicted": p["peak"],
        "peak_phase": p.get("peak_phase"),
        "measured": m.get("peak"),
        "cuda_max_allocated": m.get("cuda_max_allocated"),
    }
    s["error"] = p["peak"] / s["measured"] - 1 if s["measured"] else None
    s["error_cuda"] = p["peak"] / s["cuda_max_allocated"] - 1 if s["cuda_max_allocated"] else None
    with open(out, "w") as f:
        json.dump(s, f)
    line = f"{s['strategy']}: predicted {size(s['predicted'])}, measured {size(s['measured'])} ({signed(s['error'])})"
    if s["cuda_max_allocated"]:
        line += f", cuda max_allocated {size(s['cuda_max_allocated'])} ({signed(s['error_cuda'])})"
    print(line)
    return 0


def plan_mb(path):
    """`plan --json`: the chosen candidate's largest micro-batch and its peak (GiB)."""
    with open(path) as f:
        plan = json.load(f)
    chosen = next(c for c in plan["candidates"] if c["strategy"] == plan["chosen"])
    print(plan["max_micro_batch"] if chosen["fits"] else 0, f"{chosen['memory']['peak'] / GiB:.1f}")
    return 0


def backend(d):
    """run.json names no backend for one process; fsdp and DeepSpeed still make a process
    group of one (distributed.ensure_process_group): nccl on CUDA, gloo on CPU."""
    if d.get("backend"):
        return d["backend"]
    if d.get("engine") == "ddp":
        return "none (one process, no DDP wrapper)"
    return ("nccl" if d.get("device") == "cuda" else "gloo") + " (group of one)"


def record(results, part, name, status, detail, cmd, data=""):
    entry = {"part": int(part), "name": name, "status": status, "detail": detail, "cmd": cmd}
    if data and os.path.exists(data):
        with open(data) as f:
            entry["data"] = json.load(f)
    with open(results, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return 0


def summary(results, env_path, out, mode, wall_s):
    with open(results) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    e = {}
    if os.path.exists(env_path):
        with open(env_path) as f:
            e = json.load(f)
    device = e.get("device_name") or "CPU"
    md = [f"# scaletrain GPU checklist: {device} ({mode} mode)", ""]
    md.append(
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}, host {e.get('host')}: scaletrain {e.get('scaletrain')}, "
        f"python {e.get('python')}, torch {e.get('torch')} (CUDA {e.get('torch_cuda')}, NCCL {e.get('nccl', '-')}), "
        f"deepspeed {e.get('deepspeed')}; device memory {size(e.get('device_memory'))}; "
        f"nvcc (for DeepSpeed's FusedAdam): {e.get('nvcc_release') or 'none'}. Wall time of the checklist: {wall_s} s."
    )
    md += ["", "## Checks", "", "| part | check | result | detail |", "|---|---|---|---|"]
    for r in entries:
        md.append(f"| {r['part']} | {r['name']} | {r['status']} | {r['detail'].replace('|', '/')} |")

    engines = [r for r in entries if r["part"] == 2 and "data" in r]
    if engines:
        md += [
            "",
            "## Engines (world size 1)",
            "",
            "| run | engine | backend | first loss | last loss | tokens/s | peak memory | result |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in engines:
            d = r["data"]
            md.append(
                f"| {r['name']} | {d.get('engine')} | {backend(d)} | "
                f"{num(d.get('first_loss'), 3)} | {num(d.get('last_loss'), 3)} | {num(d.get('tokens_per_s'))} | "
                f"{size(d.get('mem_peak_bytes'))} | {r['status']} |"
            )
    plans = [r for r in entries if r["part"] == 3 and "data" in r]
    if plans:
        md += [
            "",
            "## Planner: predicted vs measured peak (`plan --measure`, 3 steps, this rank)",
            "",
            "| config | strategy | predicted | measured (MemTracker) | error | CUDA max allocated | error | predicted peak phase |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in plans:
            d = r["data"]
            md.append(
                f"| {r['name']} | {d['strategy']} | {size(d['predicted'])} | {size(d['measured'])} | {signed(d['error'])} | "
                f"{size(d.get('cuda_max_allocated'))} | {signed(d.get('error_cuda'))} | {d.get('peak_phase')} |"
            )
    mfu = [r for r in entries if r["part"] == 4 and "data" in r]
    if mfu:
        md += [
            "",
            "## MFU (median over the log intervals after the first)",
            "",
            "| run | tokens/s | MFU | step (ms) | peak memory | peak FLOP/s (source) | result |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in mfu:
            d = r["data"]
            peak = f"{d['peak_flops'] / 1e12:.3g} TFLOP/s ({d.get('peak_flops_source')})" if d.get("peak_flops") else "-"
            step = None if d.get("step_s") is None else 1000 * d["step_s"]
            md.append(
                f"| {r['name']} | {num(d.get('tokens_per_s'))} | {pct(d.get('mfu'))} | {num(step, 1)} | "
                f"{size(d.get('mem_peak_bytes'))} | {peak} | {r['status']} |"
            )
        md += [
            "",
            "## Where the time goes (ms per step; share of the step)",
            "",
            "| run | data | forward | backward | optimizer | exposed comm | other | step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in mfu:
            d, ph = r["data"], r["data"].get("phases") or {}
            step = d.get("step_s")

            def cell(v):
                if v is None:
                    return "-"
                return f"{1000 * v:.1f} ({100 * v / step:.0f}%)" if step else f"{1000 * v:.1f}"

            md.append(
                f"| {r['name']} | "
                + " | ".join(cell(ph.get(k)) for k in ("data_s", "forward_s", "backward_s", "optimizer_s", "comm_s", "other_s"))
                + f" | {num(None if step is None else 1000 * step, 1)} |"
            )
    md += ["", "## Commands", ""]
    for r in entries:
        if r.get("cmd"):
            md.append(f"- {r['name']}: `{r['cmd']}`")
    with open(out, "w") as f:
        f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(globals()[sys.argv[1].replace("-", "_")](*sys.argv[2:]))
