"""What rank 0 shows a person: a live progress bar on a terminal, plain lines otherwise, and a summary."""

from __future__ import annotations

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
