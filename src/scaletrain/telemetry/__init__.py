"""Metrics recording, the metrics.jsonl log, and the terminal display."""

from scaletrain.telemetry.metrics import MetricsLog, StepRecorder, read_metrics
from scaletrain.telemetry.progress import TrainProgress, print_banner, print_run_summary, print_summary

__all__ = [
    "MetricsLog",
    "StepRecorder",
    "TrainProgress",
    "print_banner",
    "print_run_summary",
    "print_summary",
    "read_metrics",
]
