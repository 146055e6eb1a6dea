"""What rank 0 shows a person: a live progress bar on a terminal, plain lines otherwise, and a summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, console: Console, total_steps: int, start_step: int, log_every: int, enabled: bool):
        self.console = console
        self.enabled = enabled
        self.total = total_steps
        self.eval: dict[str, Any] | None = None  # the last evaluation's row (training/evaluation.py)
        self._bar: Progress | None = None
        if enabled and console.is_terminal:
            self._bar = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                # Says what it shows: the mean over the last log interval, which differs from
                # the last step's loss that the summary quotes beside it.
                TextColumn(f"mean loss of the last {log_every} steps {{task.fields[loss]}}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[eval]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, loss="-", tps="-", eval="")
            self._bar.start()

    def advance(self, step: int) -> None:
        if self._bar:
            self._bar.update(self._task, completed=step)

    def show(self, flushed: Any) -> None:
        """One log interval (telemetry.metrics.Flushed): its mean loss, and the throughput
        over its wall time, the metrics sync included."""
        rows = flushed.rows
        if not (self.enabled and rows):
            return
        # Interval means: a single micro-batch's loss is too noisy to read progress from.
        last = rows[-1]
        loss = sum(r["loss"] for r in rows) / len(rows)
        interval = next(e for e in flushed.events if e["event"] == "interval")
        tps = interval["tokens_per_s"]
        mfu = f"  MFU {interval['mfu']:.1%}" if interval["mfu"] is not None else ""
        evaluated = f"  eval loss {self.eval['loss']:.4f} (step {self.eval['step']})" if self.eval else ""
        # A mixture of experts: the loss is the cross entropy; its routers' terms, per forward, beside it.
        aux = (interval.get("moe") or {}).get("aux")
        evaluated = (f"  moe aux {aux:.4f}" if aux is not None else "") + evaluated
        if self._bar:
            self._bar.update(self._task, loss=f"{loss:.4f}", tps=f"{tps:,.0f}")
        else:
            self.console.print(
                f"step {last['step']}/{self.total}  mean loss (steps {rows[0]['step']}-{last['step']}) {loss:.4f}  "
                f"lr {last['lr']:.2e}  grad_norm {last['grad_norm']:.3f}  {tps:,.0f} tok/s{mfu}{evaluated}",
                highlight=False,
                soft_wrap=True,
            )

    def evaluated(self, row: dict[str, Any]) -> None:
        """An evaluation's row: said now, and its loss in every progress line after it; a
        task's (eval.tasks) said now."""
        if row["event"] == "task":
            if self.enabled:
                self.console.print(task_line(row), highlight=False, soft_wrap=True)
            return
        self.eval = row
        if not self.enabled:
            return
        if self._bar:
            self._bar.update(self._task, eval=f"eval loss {row['loss']:.4f} (step {row['step']})")
        self.console.print(
            f"eval at step {row['step']}: loss {row['loss']:.4f}  perplexity {row['perplexity']:.2f}  "
            f"({row['tokens']:,} tokens of {row['data']}, {row['eval_s']:.1f} s)",
            highlight=False,
            soft_wrap=True,
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
        f"[bold]scaletrain[/] model {model_label(cfg, model)}: {model.counts().total / 1e6:.2f}M params, "
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


def print_run_summary(console: Console, paths: Any, summary: dict[str, Any], resume_from: Path | None) -> dict[str, float | None]:
    """The run's closing table, from its metrics; returns its last logged training loss and
    last eval loss (None where it has none), read in the same pass (scaletrain.train's summary)."""
    from scaletrain.checkpoint import complete_checkpoints
    from scaletrain.telemetry.metrics import read_metrics

    everything = read_metrics(paths.metrics, events=True) if paths.metrics.exists() else []
    rows = [r for r in everything if "event" not in r]
    intervals = [r for r in everything if r.get("event") == "interval"]
    evals = [r for r in everything if r.get("event") == "eval"]
    items = [("run directory", str(paths.root)), ("steps", str(summary["steps"]))]
    if rows:
        tail = rows[-intervals[-1]["steps"] :] if intervals else rows[-1:]
        items += [
            ("loss", f"{rows[0]['loss']:.4f} (step {rows[0]['step']}) -> {rows[-1]['loss']:.4f} (step {rows[-1]['step']})"),
            (
                "mean loss, last steps",
                f"{sum(r['loss'] for r in tail) / len(tail):.4f} (steps {tail[0]['step']}-{tail[-1]['step']}, what the bar shows)",
            ),
            ("tokens seen", f"{rows[-1]['tokens']:,}"),
        ]
    if evals:
        e = evals[-1]
        items.append(
            ("eval loss", f"{e['loss']:.4f}, perplexity {e['perplexity']:.2f} (step {e['step']}, {e['tokens']:,} tokens)")
        )
    if intervals:
        tps = sorted(r["tokens_per_s"] for r in intervals)
        last = intervals[-1]
        items.append(("median tokens/s", f"{tps[len(tps) // 2]:,.0f} (over each log interval, syncs included)"))
        if last["mfu"] is not None:
            items.append(("MFU (last interval)", f"{last['mfu']:.1%}"))
        cost = f", cost {last['cost']:,.2f}" if last["cost"] is not None else ""
        items.append(("device-hours", f"{last['gpu_hours']:.4f}{cost}"))
    items += [
        ("wall time (this run)", f"{summary['elapsed_s']:.1f} s" + (f", resumed from {resume_from.name}" if resume_from else "")),
        ("metrics", str(paths.metrics)),
        ("config", str(paths.config)),
        ("checkpoints", ", ".join(p.name for _, p in complete_checkpoints(paths.checkpoints)) or "none"),
    ]
    print_summary(console, "training finished", items)
    return {"loss": rows[-1]["loss"] if rows else None, "eval_loss": evals[-1]["loss"] if evals else None}


def task_line(row: dict[str, Any]) -> str:
    """A task's row as one line: "task hs at step 8: acc 0.4500  acc_norm 0.5000 (40 items, 0-shot, 1.2 s)"."""
    figures = "  ".join(f"{k} {row[k]:.4f}" for k in ("acc", "acc_norm", "perplexity") if k in row)
    return (
        f"task {row['task']} at step {row['step']}: {figures} ({row['items']} items, {row['shots']}-shot, {row['eval_s']:.1f} s)"
    )


def model_label(cfg: Any, model: Any) -> str:
    """The built-in model's preset, a Hugging Face model's type and where it came from, or a
    model of your own's name and the function that made it."""
    from scaletrain.config.sources import SOURCES

    return SOURCES[cfg.model.source].label(cfg.model, model)
