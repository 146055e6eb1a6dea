"""What rank 0 shows a person: a live progress bar on a terminal, plain lines otherwise, and a summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, console: Console, total_steps: int, start_step: int, enabled: bool):
        self.console = console
        self.enabled = enabled
        self.total = total_steps
        self._bar: Progress | None = None
        if enabled and console.is_terminal:
            self._bar = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, loss="-", tps="-")
            self._bar.start()

    def advance(self, step: int) -> None:
        if self._bar:
            self._bar.update(self._task, completed=step)

    def show(self, rows: list[dict[str, Any]]) -> None:
        if not (self.enabled and rows):
            return
        # Interval means: a single micro-batch's loss is too noisy to read progress from.
        last = rows[-1]
        loss = sum(r["loss"] for r in rows) / len(rows)
        tps = sum(r["tokens_per_s"] for r in rows) / len(rows)
        if self._bar:
            self._bar.update(self._task, loss=f"{loss:.4f}", tps=f"{tps:,.0f}")
        else:
            self.console.print(
                f"step {last['step']}/{self.total}  loss {loss:.4f}  lr {last['lr']:.2e}  "
                f"grad_norm {last['grad_norm']:.3f}  {tps:,.0f} tok/s",
                highlight=False,
            )

    def close(self) -> None:
        if self._bar:
            self._bar.stop()


def print_summary(console: Console, title: str, items: list[tuple[str, str]]) -> None:
    # Plain lines that never wrap, so paths stay whole and copy-pastable on any width.
    console.rule(title)
    width = max(len(k) for k, _ in items)
    for key, value in items:
        console.print(f"[bold]{key:<{width}}[/]  {value}", soft_wrap=True, highlight=False)


def print_banner(
    console: Console,
    cfg: Any,
    world: Any,
    model: Any,
    samples_per_epoch: int,
    tokens_per_step: int,
    global_batch: int,
    peak_lr: float,
    resume_from: Path | None,
) -> None:
    """One line: what trains, where, on what; and the learning rate when scaled."""
    where = f"{cfg.parallel.strategy} | world {world.world_size} x {world.device.type}" + (
        f" ({world.backend})" if world.backend else ""
    )
    console.print(
        f"[bold]scaletrain[/] model {cfg.model.preset}: {model.counts().total / 1e6:.2f}M params, "
        f"{model.flops_per_token(cfg.data.seq_len) / 1e6:.1f} MFLOPs/token | {where} | {cfg.precision} | "
        f"data {samples_per_epoch:,} samples/epoch of {cfg.data.seq_len} tokens | {tokens_per_step:,} tokens/step"
        + (f" | resuming from {resume_from}" if resume_from else ""),
        highlight=False,
        soft_wrap=True,
    )
    if peak_lr != cfg.train.lr:
        console.print(
            f"lr scaling ({cfg.train.lr_scaling}): train.lr {cfg.train.lr:g} at {cfg.train.lr_base_batch} sequences "
            f"-> {peak_lr:g} at the global batch of {global_batch}",
            highlight=False,
            soft_wrap=True,
        )


def print_run_summary(console: Console, paths: Any, summary: dict[str, Any], resume_from: Path | None) -> None:
    from scaletrain.checkpoint import complete_checkpoints
    from scaletrain.telemetry.metrics import read_metrics

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
        ("checkpoints", ", ".join(p.name for _, p in complete_checkpoints(paths.checkpoints)) or "none"),
    ]
    print_summary(console, "training finished", items)
