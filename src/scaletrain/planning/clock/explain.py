"""`scaletrain plan --explain-time`: the chosen layout's predicted step split into
telemetry's phases (telemetry/clock.py), each with its largest items, the rates it was
priced at and what was assumed; `diagnose` lines the same phases up with a run's."""

from __future__ import annotations

from rich.console import Console

from scaletrain.planning.clock.phases import PHASES, StepTime

# What each phase of the prediction holds, as telemetry measures it: exposed communication,
# the bubble and offload happen inside forward and backward in a measured step.
MEANING = {
    "data": "the loop reads a window of tokens per micro-batch (stated)",
    "forward": "every micro-batch's forward: the traced operations at their rates, the engine's copies",
    "backward": "every micro-batch's backward (and the recompute of activation checkpointing)",
    "optimizer": "the optimizer's step, gradient clipping",
    "comm": "collectives no compute hides (measured inside forward and backward)",
    "bubble": "pipeline stages idle in the schedule (measured inside forward)",
    "offload": "host transfers and the host's optimizer (inside forward, backward and the step)",
    "other": "the loop's own per-step work (stated)",
}


def print_time(console: Console, label: str, t: StepTime) -> None:
    total = t.total
    console.print(f"[bold]predicted step of {label}[/]: {total:.4g} s ({t.source})", highlight=False, soft_wrap=True)
    for phase in PHASES:
        seconds = t.phases.get(phase, 0.0)
        if not seconds:
            continue
        console.print(
            f"  {phase:<10} {seconds:10.4g} s  {seconds / total:6.1%}  {MEANING[phase]}", highlight=False, soft_wrap=True
        )
        for item, s in t.largest.get(phase, ())[:3]:
            console.print(f"  {'':<10} {s:10.4g} s          {item}", highlight=False, soft_wrap=True)
    for note in t.notes:
        console.print(f"  - {note}", highlight=False, soft_wrap=True)
