"""The training loop, in the order of the data flow:
world -> run directory -> data -> model -> engine -> resume -> steps (metrics, checkpoints) -> summary.
"""

from __future__ import annotations

import gc
import json
import time
from datetime import datetime, timezone
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from scaletrain import checkpoint, faults
from scaletrain.config import Config
from scaletrain.data import PackedTokens, RankBatches, ensure_prepared, resolve_dataset_dir
from scaletrain.distributed import World, all_hostnames, init_distributed, on_main_then_all, shutdown, versions
from scaletrain.engines import Engine, build_engine
from scaletrain.errors import UserError
from scaletrain.models import build_meta_model, count_params, flops_per_token, loss_fn, materialize, resolve_shape
from scaletrain.optim import lr_at, scaled_lr
from scaletrain.plan.runtime import plan_run
from scaletrain.telemetry import MetricsLog, StepRecorder, TrainProgress, print_summary, read_metrics

@dataclass
class RunPaths:
    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def run_info(self) -> Path:
        return self.root / "run.json"


def train(cfg: Config, console: Console | None = None) -> dict[str, Any]:
    world = init_distributed(cfg.run.device, cfg.parallel.backend)
    try:
        return _train(cfg, world, console or Console())
    finally:
        # A DDP model still alive at destroy_process_group intermittently aborts gloo
        # ("terminate called without an active exception"); _train dropped its engine,
        # and this frees what reference cycles still hold before the group goes.
        gc.collect()
        shutdown(world)


def _train(cfg: Config, world: World, console: Console) -> dict[str, Any]:
    main = world.is_main
    paths = RunPaths(Path(cfg.run.dir))
    resume_from = _resume_point(cfg.train.resume, paths)
    if main:
        paths.root.mkdir(parents=True, exist_ok=True)

    data = PackedTokens(_prepared_data(cfg, world), cfg.data.seq_len, cfg.train.seed)
    shape = resolve_shape(cfg.model, data.vocab_size)
    cfg, plan_lines = plan_run(cfg, world, shape)  # before any allocation; resolves strategy=auto
    if main:
        paths.config.write_text(cfg.to_yaml())
        for line in plan_lines:
            console.print(line, highlight=False, soft_wrap=True)
    torch.manual_seed(cfg.train.seed)
    model = build_meta_model(shape, max_seq_len=cfg.data.seq_len)
    engine = build_engine(model, world, cfg, lambda m, device: materialize(m, device, cfg.train.seed))
    del model  # the engine holds it (wrapped); see the finally below
    hosts = all_hostnames(world)
    if main:
        for name, text in engine.checkpoint_files().items():  # e.g. the exact DeepSpeed JSON
            (paths.root / name).write_text(text)
        _write_run_info(paths, cfg, world, engine.name, hosts, resume_from)

    metrics = MetricsLog(paths.metrics, enabled=main)
    step, position, tokens_seen = 0, 0, 0
    if resume_from is not None:
        trainer_state = checkpoint.load_checkpoint(resume_from, world, engine.load)
        engine.load_extra_state(trainer_state["engine"])
        step, position, tokens_seen = trainer_state["step"], trainer_state["data_position"], trainer_state["tokens_seen"]
    metrics.truncate_after(step)

    global_batch = cfg.train.micro_batch * cfg.train.grad_accum * world.world_size
    tokens_per_step = global_batch * cfg.data.seq_len
    peak_lr = scaled_lr(cfg.train, global_batch)
    if main:
        _print_banner(console, cfg, world, engine.name, shape, data, tokens_per_step, resume_from)
        if peak_lr != cfg.train.lr:
            console.print(
                f"lr scaling ({cfg.train.lr_scaling}): train.lr {cfg.train.lr:g} at {cfg.train.lr_base_batch} sequences "
                f"-> {peak_lr:g} at the global batch of {global_batch}",
                highlight=False,
                soft_wrap=True,
            )

    batches = RankBatches(data, cfg.train.micro_batch, cfg.train.grad_accum, world.rank, world.world_size, start=position)
    recorder = StepRecorder(world.world_size, world.distributed)
    progress = TrainProgress(console, cfg.train.steps, step, enabled=main)
    started = time.perf_counter()
    start_step = step
    try:
        while step < cfg.train.steps:
            t0 = time.perf_counter()
            lr = lr_at(step, cfg.train, peak_lr)
            loss = train_step(engine, batches.next_step(), world.device)
            stats = engine.step(lr)
            step += 1
            tokens_seen += tokens_per_step
            dt = time.perf_counter() - t0
            recorder.record(
                loss, stats.grad_norm, step=step, lr=lr, tokens_per_s=tokens_per_step / dt, step_time_s=dt,
                tokens=tokens_seen, **({"loss_scale": stats.loss_scale, "skipped": stats.skipped} if stats.loss_scale else {}),
            )
            progress.advance(step)
            save_now = step == cfg.train.steps or (cfg.checkpoint.every > 0 and step % cfg.checkpoint.every == 0)
            if save_now or step % cfg.train.log_every == 0:
                rows = recorder.flush()
                metrics.write(rows)
                progress.show(rows)
            if save_now:
                _save(cfg, world, engine, paths, step, batches.position, tokens_seen)
            faults.kill_at("step", step)
    finally:
        progress.close()
        # An exception's traceback keeps this frame's locals alive; the engine (a DDP
        # wrapper, say) must not outlive the process group (see train()).
        del engine

    elapsed = time.perf_counter() - started
    summary = {"run_dir": str(paths.root), "steps": step, "steps_this_run": step - start_step, "elapsed_s": elapsed}
    if main:
        _print_summary(console, paths, summary, resume_from)
    return summary


def train_step(engine: Engine, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Forward/backward over the accumulation window; returns the mean loss (on device, no sync)."""
    total = torch.zeros((), device=device)
    n = len(micro_batches)
    for i, (inputs, targets) in enumerate(micro_batches):
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with engine.accumulate(boundary=i == n - 1):
            with engine.autocast():
                loss = loss_fn(engine.model(inputs), targets)
            # Mean over the window: every micro-batch holds the same number of tokens.
            engine.backward(loss / n)
        total += loss.detach()
    return total / n


def _resume_point(resume: str, paths: RunPaths) -> Path | None:
    latest = checkpoint.latest_complete(paths.checkpoints)
    if resume == "auto":
        return latest
    if resume == "never":
        if latest is not None:
            raise UserError(
                f"train.resume=never but run.dir {paths.root} already holds checkpoints (newest {latest.name}); "
                "accepted: train.resume=auto to continue it, or another run.dir for a fresh run"
            )
        return None
    path = Path(resume)
    if not path.is_dir():
        raise UserError(f"train.resume={resume!r}: no such checkpoint directory; accepted: auto, never, or a checkpoints/step_<N> path")
    if not checkpoint.is_complete(path):
        raise UserError(f"train.resume={resume!r} is an incomplete checkpoint (no {checkpoint.MARKER} marker); accepted: a complete one")
    return path


def _prepared_data(cfg: Config, world: World) -> Path:
    # Every rank validates the paths (same error everywhere); rank 0 alone tokenizes.
    resolve_dataset_dir(cfg.data)
    on_main_then_all(world, lambda: ensure_prepared(cfg.data, show_progress=True))
    return resolve_dataset_dir(cfg.data)[0]


def _save(cfg: Config, world: World, engine: Engine, paths: RunPaths, step: int, position: int, tokens_seen: int) -> None:
    trainer_state = {
        "step": step,
        "data_position": position,  # the global sample index where step+1 starts
        "tokens_seen": tokens_seen,
        "world_size": world.world_size,
        "scheduler": {"name": "warmup_cosine", "step": step},
        "engine": engine.extra_state(),
    }
    target = checkpoint.step_dir(paths.checkpoints, step)
    files = {"config.yaml": cfg.to_yaml(), **engine.checkpoint_files()}
    checkpoint.save_checkpoint(target, world, engine.save, trainer_state, files)
    if world.is_main:
        checkpoint.prune(paths.checkpoints, cfg.checkpoint.keep)


def _write_run_info(paths: RunPaths, cfg: Config, world: World, engine_name: str, hosts: list[str], resume_from: Path | None) -> None:
    """run.json: what ran where, for tools and tests (the banner is for people)."""
    info = {
        "engine": engine_name,
        "world_size": world.world_size,
        "backend": world.backend,
        "device": world.device.type,
        "precision": cfg.precision,
        "hosts": hosts,  # by rank
        "versions": versions(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "resumed_from": str(resume_from) if resume_from else None,
    }
    checkpoint.write_atomic(paths.run_info, json.dumps(info, indent=1) + "\n")


def _print_banner(console: Console, cfg: Config, world: World, engine_name: str, shape: Any, data: PackedTokens, tokens_per_step: int, resume_from: Path | None) -> None:
    params = count_params(shape)
    where = f"{engine_name} | world {world.world_size} x {world.device.type}" + (f" ({world.backend})" if world.backend else "")
    console.print(
        f"[bold]scaletrain[/] model {cfg.model.preset}: {params['total'] / 1e6:.2f}M params, "
        f"{flops_per_token(shape, cfg.data.seq_len) / 1e6:.1f} MFLOPs/token | {where} | {cfg.precision} | "
        f"data {data.samples_per_epoch:,} samples/epoch of {cfg.data.seq_len} tokens | {tokens_per_step:,} tokens/step"
        + (f" | resuming from {resume_from}" if resume_from else ""),
        highlight=False,
        soft_wrap=True,
    )


def _print_summary(console: Console, paths: RunPaths, summary: dict[str, Any], resume_from: Path | None) -> None:
    rows = read_metrics(paths.metrics) if paths.metrics.exists() else []
    items = [("run directory", str(paths.root)), ("steps", str(summary["steps"]))]
    if rows:
        tps = sorted(r["tokens_per_s"] for r in rows)
        items += [
            ("loss", f"{rows[0]['loss']:.4f} (step {rows[0]['step']}) -> {rows[-1]['loss']:.4f} (step {rows[-1]['step']})"),
            ("tokens seen", f"{rows[-1]['tokens']:,}"),
            ("median tokens/s", f"{tps[len(tps) // 2]:,.0f}"),
        ]
    items += [
        ("wall time (this run)", f"{summary['elapsed_s']:.1f} s" + (f", resumed from {resume_from.name}" if resume_from else "")),
        ("metrics", str(paths.metrics)),
        ("config", str(paths.config)),
        ("checkpoints", ", ".join(p.name for _, p in checkpoint.complete_checkpoints(paths.checkpoints)) or "none"),
    ]
    print_summary(console, "training finished", items)
