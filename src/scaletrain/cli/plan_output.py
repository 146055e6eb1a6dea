"""`scaletrain plan`'s output: the plan (training/planned.py) as a table or JSON, with
--explain-time's phases. Imported by plan.py once the config is good."""

from __future__ import annotations

import argparse
import json

from scaletrain.cli.console import console
from scaletrain.config import Config
from scaletrain.planning.clock.explain import print_time
from scaletrain.planning.report import print_plan
from scaletrain.telemetry.progress import model_label
from scaletrain.training.planned import build_plan


def show_plan(cfg: Config, opts: argparse.Namespace) -> int:
    plan, goodput, model = build_plan(cfg, opts)
    time = plan.chosen.time if getattr(opts, "explain_time", False) else None
    if opts.json:
        extra = ({"goodput": goodput.as_dict()} if goodput else {}) | ({"time": time.as_dict()} if time else {})
        print(json.dumps(plan.as_dict() | extra, indent=1))
    else:
        print_plan(console(), plan, model, f"plan for model {model_label(cfg, model)}")
        if time is not None:
            print_time(console(), plan.chosen.setup.label, time)
    return 0
