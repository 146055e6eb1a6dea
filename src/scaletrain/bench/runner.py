"""`scaletrain bench`: each engine's runs of scaletrain's loop and of the others, interleaved.

Per engine and round, scaletrain's run and the raw loop's (bench/raw.py) run back to back,
in alternating order (A B, then B A, ...): a machine that slows down or speeds up over the
benchmark then weighs on both alike, and each round gives one paired ratio. With `peers`,
the same round also runs the Hugging Face model of the built-in model's exact shape under
scaletrain, HF Trainer and (DDP) Accelerate (bench/peers.py).

Every run is its own torchrun job with the same resolved config (written once per engine),
so process start, rendezvous and the first step's warm-up cost each the same; the first
logging interval (warm-up) is left out of every figure.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletrain.bench import forked_runs
from scaletrain.config import Config, ModelConfig
from scaletrain.config.batch import global_batch
from scaletrain.errors import UserError
from scaletrain.strategies import STRATEGIES

# The strategies each peer is benchmarked on (HF Trainer: DDP and, through DeepSpeed JSON,
# ZeRO-2; Accelerate: its DDP). Bench data, keyed by strategy name: which runs this bench
# makes, not what a strategy can do. Every key is a row of scaletrain.strategies
# (tests/test_bench.py checks it against STRATEGIES).
PEERS = {"ddp": ("scaletrain-hf", "hf-trainer", "accelerate"), "zero2": ("scaletrain-hf", "hf-trainer")}
# Where each variant's loop lives: scaletrain itself, or a module of this package.
MODULES = {"raw": "scaletrain.bench.raw", "hf-trainer": "scaletrain.bench.peers", "accelerate": "scaletrain.bench.peers"}
Say = Callable[[str], None]  # where progress lines go


@dataclass
class Run:
    """One finished run: its measured intervals (steps, wall seconds), per-step (or
    per-interval, for HF Trainer) losses and the peak memory of its busiest rank."""

    variant: str
    engine: str
    round: int
    intervals: list[list[float]]
    losses: list[list[float]]
    peak_bytes: int
    tokens_per_step: int

    @property
    def step_s(self) -> float:
        """Mean step time after the first interval: all of it, syncs and every periodic cost included."""
        measured = self.intervals[1:]
        return sum(w for _, w in measured) / sum(n for n, _ in measured)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def final_loss(self) -> float:
        """The mean loss of the last interval (HF Trainer logs only such means)."""
        if len(self.losses) == len(self.intervals):
            return self.losses[-1][1]
        last = self.losses[-int(self.intervals[-1][0]) :]
        return sum(v for _, v in last) / len(last)


@dataclass
class Bench:
    strategies: list[str]
    nproc: int
    rounds: int
    peers: bool
    out: Path
    vocab_size: int  # the tokenizer's: the built-in model's shape depends on it
    runs: list[Run] = field(default_factory=list)


def variants(strategy: str, peers: bool) -> list[str]:
    return ["scaletrain", "raw"] + (list(PEERS.get(strategy, ())) if peers else [])


def schedule(strategies: list[str], rounds: int, peers: bool) -> list[tuple[str, int, str]]:
    """(strategy, round, variant) in the order they run: per engine and round the variants
    back to back, in alternating order (A B, then B A, ...): drift weighs on both alike."""
    order = []
    for strategy in strategies:
        names = variants(strategy, peers)
        for r in range(rounds):
            order += [(strategy, r, name) for name in (names if r % 2 == 0 else names[::-1])]
    return order


def check_request(cfg: Config, strategies: list[str], nproc: int, rounds: int) -> None:
    """What the raw loops cannot mirror, said before anything runs."""
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise UserError(f"--strategies {','.join(strategies)}: unknown {bad or 'none given'}; accepted: {','.join(STRATEGIES)}")
    if nproc < 1 or rounds < 1:
        raise UserError(f"--nproc {nproc} --rounds {rounds}: accepted: both at least 1")
    p, t = cfg.parallel, cfg.train
    unmirrored = {
        "parallel.tp": p.tp != 1,
        "parallel.pp": p.pp != 1,
        "parallel.dp_replicate": p.dp_replicate != 1,
        "parallel.activation_checkpointing": p.activation_checkpointing,
        "parallel.offload_params": p.offload_params != "none",
        "parallel.grad_compression": p.grad_compression != "none",
        "train.compile": t.compile,
        "model.teacher": cfg.model.teacher is not None,
        "model.lora": cfg.model.lora is not None,
        "model.trainable": bool(cfg.model.trainable),
    }
    used = [k for k, on in unmirrored.items() if on]
    if used:
        raise UserError(
            f"scaletrain bench compares data-parallel loops and its raw loops do not mirror {', '.join(used)}; "
            "accepted: the config without them (plain ddp, fsdp or zero1-3, any precision and batch)"
        )
    if t.steps < 2 * t.log_every:
        raise UserError(
            f"train.steps={t.steps} gives fewer than 2 intervals of train.log_every={t.log_every} steps (the first is "
            f"warm-up and left out); accepted: --steps of at least {2 * t.log_every}"
        )


def run_bench(cfg: Config, strategies: list[str], nproc: int, rounds: int, peers: bool, out: Path, say: Say) -> Bench:
    from scaletrain.data import PackedTokens, ensure_prepared

    check_request(cfg, strategies, nproc, rounds)
    data = PackedTokens(ensure_prepared(cfg.data), cfg.data.seq_len, cfg.train.seed)  # once, before any timed run
    bench = Bench(strategies, nproc, rounds, peers, out, data.vocab_size)
    tokens_per_step = global_batch(cfg.train, nproc) * cfg.data.seq_len
    configs = {(s, name): _config_for(cfg, s, name, data, out) for s in strategies for name in variants(s, peers)}
    for strategy, r, name in schedule(strategies, rounds, peers):
        say(f"bench: {strategy} {name} round {r + 1}/{rounds}")
        result = _launch(name, configs[strategy, name], nproc, run_path(out, strategy, name, r))
        bench.runs.append(Run(name, strategy, r, result["intervals"], result["losses"], result["peak_bytes"], tokens_per_step))
    return bench


def config_path(out: Path, strategy: str, variant: str) -> Path:
    return out / strategy / f"{variant}.yaml"


def run_path(out: Path, strategy: str, variant: str, r: int) -> Path:
    return out / strategy / f"{variant}-r{r + 1}"


def _config_for(cfg: Config, strategy: str, variant: str, data: Any, out: Path) -> Path:
    """The resolved config of one engine's variant, written once: every round reads it."""
    resolved = cfg.model_copy(deep=True)
    resolved.parallel.strategy = strategy
    resolved.train.resume = "never"
    resolved.data.paths = [str(data.dir)]  # the prepared tokens: no run re-reads the corpus
    if variant != "scaletrain" and variant != "raw":
        resolved.model = hf_model_of(cfg, data)
    path = config_path(out, strategy, variant)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(resolved.to_yaml())
    return path


def hf_model_of(cfg: Config, data: Any) -> Any:
    """The Hugging Face Llama of the built-in model's exact shape (HF export's mapping)."""
    from scaletrain.checkpoint.hf_export import hf_config  # torch
    from scaletrain.models import resolve_shape

    if cfg.model.source != "builtin":
        return cfg.model.model_copy(deep=True)
    shape = resolve_shape(cfg.model, data.vocab_size)
    return ModelConfig(source="hf", hf_config=hf_config(shape, cfg.data.seq_len, "fp32", data.eos_id))


def command(variant: str, config: Path, nproc: int, run_dir: Path) -> list[str]:
    """The torchrun job of one run: `scaletrain train`, or the variant's loop (MODULES)
    writing its result.json into the run directory."""
    if variant in ("scaletrain", "scaletrain-hf"):
        args = ["-m", "scaletrain", "train", str(config), f"run.dir={run_dir}"]
    else:
        which = [variant] if variant in ("hf-trainer", "accelerate") else []
        args = ["-m", MODULES[variant], *which, str(config), str(run_dir / "result.json")]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone", *args]


def _launch(variant: str, config: Path, nproc: int, run_dir: Path) -> dict[str, Any]:
    """One torchrun job; its result as a dict (bench/raw.py's format)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    run_logged(command(variant, config, nproc, run_dir), run_dir / "output.log", f"the {variant} run")
    return read_scaletrain_run(run_dir) if variant.startswith("scaletrain") else json.loads((run_dir / "result.json").read_text())


def run_logged(cmd: list[str], log: Path, what: str) -> None:
    """Run `cmd` with its output into `log`; a failure ends the bench in one line: the
    last line it wrote, and where the rest is."""
    log.parent.mkdir(parents=True, exist_ok=True)
    code = forked_runs.run(cmd[3:], log) if cmd[:3] == [sys.executable, "-m", "scaletrain"] else None
    if code is None:  # not scaletrain, or where a fork could differ from a new process
        with log.open("w") as sink:
            code = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["(no output)"]
        raise UserError(f"bench: {what} failed (exit {code}): {tail[0].strip()[:300]}; its output: {log}")


def read_scaletrain_run(run_dir: Path) -> dict[str, Any]:
    """A scaletrain run's metrics.jsonl in the raw loops' result format."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    intervals = [r for r in rows if r.get("event") == "interval"]
    return {
        "intervals": [[r["steps"], r["wall_s"]] for r in intervals],
        "losses": [[r["step"], r["loss"]] for r in rows if "event" not in r and "loss" in r],
        "peak_bytes": max(r["mem_peak_bytes"] for r in intervals),
    }
