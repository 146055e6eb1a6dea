"""Every path users take, beside the trainer each of them would otherwise pick (issue 59), in one go.

    python3 scripts/gpu_peers.py "$OUT" --work /tmp/peers --budget 420      # the lent GPU's command
    .venv/bin/python scripts/gpu_peers.py OUT --tiny                           # the CPU stand-in: tiny shapes
    python3 scripts/gpu_peers.py OUT --list                                     # the runs, in order; runs nothing

Each row is one process on one device: scaletrain on the built-in `1b` preset (with no performance
flag: what a user who never reads docs/gpu.md gets), the same shape as a Hugging Face Llama through
`model.source: hf`, LoRA rank 16 on every linear layer of it, a mixture of experts, the ZeRO engines and
Muon; beside them HF Trainer (compiled, fused AdamW; with Liger's kernels; with PEFT) through
scaletrain.bench.peers, and torchtitan's Llama-3 trainer (scripts/peers/titan_llama.py). Every run has
the same tokens per step (micro-batch x sequence), precision (bf16) and AdamW settings as its peer.

Each result goes to OUT/results.jsonl the moment it is known (summary.md is rewritten after it): a run
killed at the budget's end leaves every earlier one. With --budget, a run whose expected seconds no
longer fit is skipped. A peer that is not installed or fails prints one line and the rest goes on.
TITAN_SITE names a folder of torchtitan's wheels put first on the torchtitan row's PYTHONPATH alone (its
`datasets` must not reach HF Trainer, which imports it wherever it is found).
tokens/s is the median over the log intervals after the first (compile and warm-up in that one).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINEARS = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"


@dataclass(frozen=True)
class Run:
    name: str
    path: str  # the user path this row measures: its peer rows share it
    who: str  # scaletrain | hf-trainer | torchtitan
    args: tuple[str, ...]  # scaletrain: train's overrides; hf-trainer: the config's overrides, then flags
    expect_s: float  # on an H200 (what --budget plans with); the tiny CPU runs take 20-60 s


def shapes(tiny: bool) -> dict[str, tuple[str, ...]]:
    """The model and batch each path runs: the 1b preset's shape at seq 2048, micro-batch 8, or a tiny one."""
    if tiny:
        llama = "{model_type: llama, hidden_size: 64, intermediate_size: 172, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 4096, max_position_embeddings: 64, tie_word_embeddings: true}"
        run = (
            "run.device=cpu",
            "data.seq_len=64",
            "train.micro_batch=2",
            "train.steps=6",
            "train.log_every=2",
            "train.warmup_steps=1",
            "train.lr=0.003",
        )
        builtin = ("model.preset=tiny", "model.vocab_size=4096")
        moe = ("model.preset=tiny", "model.vocab_size=4096", "model.moe={experts: 8, top_k: 2, expert_ffn_dim: 32}")
    else:
        # Llama-3.2-1B's config (without its rope scaling, which costs nothing per step): the 1b preset's shape.
        llama = ("{model_type: llama, hidden_size: 2048, intermediate_size: 8192, num_hidden_layers: 16, num_attention_heads: 32, "
                 "num_key_value_heads: 8, head_dim: 64, vocab_size: 128256, rope_theta: 500000.0, rms_norm_eps: 0.00001, "
                 "max_position_embeddings: 2048, tie_word_embeddings: true}")  # fmt: skip
        run = ("run.device=cuda", "data.seq_len=2048", "train.micro_batch=8", "train.steps=20", "train.log_every=5")
        builtin = ("model.preset=1b", "model.vocab_size=128256")
        # OLMoE-1B-7B's shape: 64 experts of 1024, top-8, dim 2048, 16 layers, 16 heads, vocabulary 50304
        # (6.9B parameters, 1.3B active); AdamW's states ~110 GB: an H200.
        moe = ("model.preset=1b", "model.vocab_size=50304", "model.n_heads=16", "model.n_kv_heads=16",
               "model.moe={experts: 64, top_k: 8, expert_ffn_dim: 1024}", "parallel.activation_checkpointing=true")  # fmt: skip
    # bf16 on a GPU; the CPU stand-in in fp32: torch's bf16 CPU kernels need its native vector
    # kernels on some CPUs (under ATEN_CPU_CAPABILITY=default an AMX machine failed: pack_vnni2).
    common = (*run, "precision=fp32" if tiny else "precision=bf16", "checkpoint.every=0", "train.resume=never")
    hf = (*common, "model.source=hf", f"model.hf_config={llama}")
    return {"builtin": (*common, *builtin), "hf": hf, "lora": (*hf, f"model.lora={{r: 16, alpha: 32, target_modules: {LINEARS}}}"),
            "moe": (*common, *moe), "run": run}  # fmt: skip


def runs(tiny: bool) -> list[Run]:
    s = shapes(tiny)
    compiled = ("train.compile=true",) if not tiny else ()
    default = (*s["run"][:2], "model.preset=1b" if not tiny else "model.preset=tiny", f"model.vocab_size={128256 if not tiny else 4096}",
               "train.steps=1000", f"train.stop_at={20 if not tiny else 6}", *[a for a in s["run"] if a.startswith("train.log_every=")],
               "checkpoint.every=0", "train.resume=never")  # fmt: skip
    titan = ("--steps", "20") if not tiny else ("--tiny", "--cpu")
    return [
        # built-in 1b: scaletrain as it comes (no precision, micro-batch, compile or loss flag: a long run's
        # defaults, stopped at step 20), then torchtitan's trainer at the same shape, compiled.
        Run("scaletrain-default", "built-in 1b", "scaletrain", default, 75),
        # (its defaults kept: FlexAttention, whose compile autotunes, and CUDA graphs: 100-200 s in all)
        Run("torchtitan-compiled", "built-in 1b", "torchtitan", titan, 150),
        # On torch 2.11 (the lent machines') its compiled FlexAttention step failed in the backward (2026-11-30:
        # "data is not allocated yet"): torchtitan's other attention for language models, torch's varlen_attn
        # (a GPU kernel: not in the CPU's stand-in, whose shims run FlexAttention as SDPA).
        *([Run("torchtitan-compiled-varlen", "built-in 1b", "torchtitan", (*titan, "--attn", "varlen"), 120)] if not tiny else []),
        # The same preset compiled, SDPA's kernel chosen by measuring (train.attention_kernel=auto: cuDNN's
        # where faster) and pinned to torch's own FlashAttention: what the choice gains (issue 59, item 2).
        Run("scaletrain-1b-compiled", "built-in 1b", "scaletrain", (*s["builtin"], "parallel.strategy=fsdp", *compiled), 70),
        Run("scaletrain-1b-compiled-flash", "built-in 1b", "scaletrain",
            (*s["builtin"], "parallel.strategy=fsdp", *compiled, "train.attention_kernel=flash"), 60),
        # Selective activation checkpointing (torchtitan's per-op policy), compiled: what it costs
        # against the same step without (the row above), and the clock's price of its recompute.
        Run("scaletrain-1b-selective-ac", "built-in 1b", "scaletrain", (*s["builtin"], "parallel.strategy=fsdp", *compiled,
            "parallel.activation_checkpointing=true", "parallel.ac_mode=selective"), 70),
        # A Hugging Face Llama of the same shape: scaletrain (model.source: hf) against HF Trainer.
        Run("scaletrain-hf-compiled", "HF Llama 1b", "scaletrain", (*s["hf"], "parallel.strategy=fsdp", *compiled), 70),
        Run("hf-trainer-compiled", "HF Llama 1b", "hf-trainer", (*s["hf"], *compiled), 70),
        # LoRA rank 16 on every linear layer: scaletrain against HF Trainer + PEFT.
        Run("scaletrain-lora", "LoRA r16", "scaletrain", (*s["lora"], "parallel.strategy=fsdp", *compiled), 60),
        Run("hf-trainer-peft", "LoRA r16", "hf-trainer", (*s["lora"], *compiled), 60),
        # Eager: a compiled mixture of experts needs torch._grouped_mm under inductor (not every torch has it).
        Run("scaletrain-moe", "MoE (OLMoE shape)", "scaletrain", (*s["moe"], "parallel.strategy=fsdp"), 150),
        Run("hf-trainer-liger", "HF Llama 1b", "hf-trainer", (*s["hf"], "--liger"), 35),
        Run("hf-trainer-peft-liger", "LoRA r16", "hf-trainer", (*s["lora"], "--liger"), 60),
        Run("scaletrain-fsdp", "engines at 1b", "scaletrain", (*s["builtin"], "parallel.strategy=fsdp"), 50),
        Run("scaletrain-zero2", "engines at 1b", "scaletrain", (*s["builtin"], "parallel.strategy=zero2"), 95),
        Run("scaletrain-zero3", "engines at 1b", "scaletrain", (*s["builtin"], "parallel.strategy=zero3"), 60),
        Run("scaletrain-muon", "engines at 1b", "scaletrain", (*s["builtin"], "parallel.strategy=fsdp", "train.optimizer=muon"), 60),
    ]  # fmt: skip


def command(r: Run, work: Path, timeout: float = 900) -> list[str]:
    """The process of one row; a peer's config is written first, resolved by scaletrain's own loader."""
    if r.who == "scaletrain":
        return [sys.executable, "-m", "scaletrain", "train", *r.args, f"run.dir={work / r.name}"]
    if r.who == "torchtitan":
        return [sys.executable, str(ROOT / "scripts" / "peers" / "titan_llama.py"), str(work / r.name / "result.json"),
                "--work", str(work / r.name / "titan"), "--budget", f"{max(10, timeout - 10):.0f}", *r.args]  # fmt: skip
    from scaletrain.config import load_config

    overrides, flags = [a for a in r.args if not a.startswith("--")], [a for a in r.args if a.startswith("--")]
    (work / r.name).mkdir(parents=True, exist_ok=True)
    config = work / r.name / "config.yaml"
    config.write_text(load_config([], overrides).to_yaml())
    return [sys.executable, "-m", "scaletrain.bench.peers", "hf-trainer", str(config), str(work / r.name / "result.json"), *flags]


def measure(r: Run, work: Path) -> dict:
    """tokens/s and the step (medians over the log intervals after the first), MFU where the run reports
    it, the peak, the losses: the `data` of a results.jsonl row as the GPU checklist writes them (a
    scaletrain row's `cmd` and `data.step_s` are what `scaletrain bench --suite clock-gpu` plans again)."""
    run_dir = work / r.name
    if r.who == "torchtitan":
        return titan_data(json.loads((run_dir / "result.json").read_text()))
    device = "cuda" if "run.device=cuda" in r.args else "cpu"
    if r.who == "scaletrain":
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        ints = [x for x in rows if x.get("event") == "interval"]
        later = ints[1:] or ints
        mfus = [x["mfu"] for x in later if x.get("mfu") is not None]
        log = (run_dir / "output.log").read_text(errors="replace").splitlines()
        return {
            "device": device, "step_s": statistics.median(x["step_s"] for x in later),
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in later), "mfu": statistics.median(mfus) if mfus else None,
            "mem_peak_bytes": max(x["mem_peak_bytes"] for x in ints), "intervals": len(later),
            "losses": [[x["step"], x["loss"]] for x in rows if "event" not in x and "loss" in x],
            "first_lines": [ln for ln in log[:60] if "defaults" in ln or "compile" in ln or ln.startswith("attention: ")][:8],
            # SDPA's kernel the run put first (train.attention_kernel; "" where torch's order stayed)
            "attention": next((ln.split()[2].removesuffix("'s") for ln in log[:60] if ln.startswith("attention: SDPA's ")), ""),
            # What the run resolved its unset keys to ("defaults: train.compile=false (...)"): clock-gpu plans that.
            # (auto stays the plan's own choice again: it needs no key)
            "resolved": [w for ln in log[:60] if ln.startswith("defaults: ") and "=" in (w := ln.split()[1]) and not w.endswith("=auto")],
        }  # fmt: skip
    res = json.loads((run_dir / "result.json").read_text())
    later = res["intervals"][1:] or res["intervals"]
    from scaletrain.config import load_config

    cfg = load_config([str(run_dir / "config.yaml")])
    tokens = cfg.train.micro_batch * cfg.train.grad_accum * cfg.data.seq_len
    step_s = statistics.median(s / n for n, s in later)
    return {"device": device, "step_s": step_s, "tokens_per_s": tokens / step_s, "mfu": None,
            "mem_peak_bytes": res["peak_bytes"], "intervals": len(later), "losses": res["losses"],
            "params": res.get("params"), "trainable": res.get("trainable")}  # fmt: skip


def titan_data(res: dict) -> dict:
    """scripts/peers/titan_llama.py's OUT.json as a row's data: torchtitan's own log's figures (tokens/s per
    GPU, MFU against its peak; memory as the largest active bytes: scaletrain's peak is allocated bytes)."""
    if res.get("error"):
        raise RuntimeError(res["error"])
    s = res["summary"]
    return {"device": "cpu" if "--cpu" in res.get("argv", []) else "cuda", "step_s": s["median_step_time_s"],
            "tokens_per_s": s["median_tps"], "mfu": s["median_mfu_pct"] / 100 if s.get("median_mfu_pct") else None,
            "mem_peak_bytes": int((s.get("peak_memory_active_gib") or 0) * 2**30), "intervals": s["n_steps_in_median"],
            "reserved_gib": s.get("peak_memory_reserved_gib"),
            "losses": [[r["step"], r["loss"]] for r in res.get("steps", []) if r.get("loss") is not None]}  # fmt: skip


def run_one(r: Run, work: Path, timeout: float) -> dict:
    (work / r.name).mkdir(parents=True, exist_ok=True)
    log = work / r.name / "output.log"
    t0 = time.monotonic()
    with log.open("w") as out:
        env = dict(os.environ)
        if r.who == "torchtitan" and os.environ.get("TITAN_SITE"):  # its wheels for its process alone (datasets, tyro, ...)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ["TITAN_SITE"], os.environ.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            command(r, work, timeout), stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT, env=env
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            rc = f"killed after {timeout:.0f} s"
    row = {"name": r.name, "path": r.path, "who": r.who, "status": "PASS", "rc": rc, "seconds": round(time.monotonic() - t0, 1),
           "cmd": shlex.join(["scaletrain", *command(r, work)[3:]]) if r.who == "scaletrain" else shlex.join(command(r, work)[1:])}  # fmt: skip
    try:
        row["data"] = measure(r, work)
    except Exception as e:  # noqa: BLE001  (a failed or cut run: its log's last lines say why)
        tail = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-3:]
        row["status"] = "FAIL"
        if isinstance(e, RuntimeError):  # the peer's own one line (scripts/peers/titan_llama.py)
            row["error"] = f"rc {rc}: {e}"
        else:
            row["error"] = (f"rc {rc}, " if rc != 0 else f"{type(e).__name__}: {e}; ") + "the log ends: " + " | ".join(tail)
    # A 1b checkpoint is ~15 GB and the lent machine's disk 64 GB: none is kept.
    shutil.rmtree(work / r.name / "checkpoints", ignore_errors=True)
    shutil.rmtree(work / r.name / "hf", ignore_errors=True)
    return row


def summary(rows: list[dict]) -> str:
    """The GPU table of docs/benchmarks.md: each path's rows, and each run's tokens/s over its path's scaletrain row's."""
    lines = ["| path | run | tokens/s | MFU | peak GiB | x scaletrain | note |", "|---|---|---|---|---|---|---|"]
    ours: dict[str, float] = {}
    for row in rows:
        if row["who"] == "scaletrain" and row.get("data"):
            ours.setdefault(row["path"], row["data"]["tokens_per_s"])
    for row in rows:
        d = row.get("data") or {}
        if not d.get("tokens_per_s"):
            lines.append(f"| {row['path']} | {row['name']} | | | | | {row.get('error', '')[:200]} |")
            continue
        tps, mfu = d["tokens_per_s"], d.get("mfu")
        ratio = f"{tps / ours[row['path']]:.2f}" if row["path"] in ours else ""
        cells = [
            row["path"],
            row["name"],
            f"{tps:,.0f}",
            f"{100 * mfu:.1f}%" if mfu else "",
            f"{d['mem_peak_bytes'] / 2**30:.1f}",
            ratio,
            "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def environment() -> dict:
    """The device the runs used, as the checklist's env.json names it (clock-gpu reads device_name and memory)."""
    import torch

    if not torch.cuda.is_available():
        return {"device_name": "cpu", "torch": torch.__version__}
    p = torch.cuda.get_device_properties(0)
    return {"device_name": p.name, "device_memory": p.total_memory, "torch": torch.__version__, "cuda": torch.version.cuda}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--work", type=Path, help="where the runs write (default: OUT/work)")
    p.add_argument("--budget", type=float, help="seconds: skip a run whose expected time no longer fits")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: the suite's stand-in")
    p.add_argument("--only", action="append", default=[], help="a run's name (repeatable)")
    p.add_argument("--list", action="store_true", help="print the runs and their commands; run nothing")
    a = p.parse_args()
    work = a.work or a.out / "work"
    # Liger's kernels are Triton's: GPU only.
    todo = [r for r in runs(a.tiny) if (not a.only or r.name in a.only) and not (a.tiny and "--liger" in r.args)]
    if a.list:
        for r in todo:
            print(f"{r.name} ({r.path}, ~{r.expect_s:.0f} s): {' '.join(r.args)}")
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "env.json").write_text(json.dumps(environment(), indent=1) + "\n")
    deadline = time.monotonic() + (a.budget or 1e9)
    rows: list[dict] = []
    for r in todo:
        left = deadline - time.monotonic() - 3
        if not a.tiny and r.expect_s > left:
            row = {"name": r.name, "path": r.path, "who": r.who, "status": "SKIP", "rc": None, "seconds": 0,
                   "error": f"skipped: ~{r.expect_s:.0f} s expected, {left:.0f} s left"}  # fmt: skip
        else:
            row = run_one(r, work, max(1.0, min(left, 3 * r.expect_s if not a.tiny else 900)))
        rows.append(row)
        with (a.out / "results.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        (a.out / "summary.md").write_text(summary(rows))
        d = row.get("data") or {}
        print(
            f"{r.name}: "
            + (
                f"{d['tokens_per_s']:,.0f} tokens/s, peak {d['mem_peak_bytes'] / 2**30:.1f} GiB"
                if d.get("tokens_per_s")
                else row.get("error", "")
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
