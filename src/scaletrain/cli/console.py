"""The rich console the commands print through: the terminal's width, or 160 columns in
pipes and logs, so that a table or a finding is never wrapped there."""

from __future__ import annotations

from rich.console import Console


def console(highlight: bool = True) -> Console:
    shown = Console(highlight=highlight)
    return shown if shown.is_terminal else Console(width=160, highlight=highlight)
