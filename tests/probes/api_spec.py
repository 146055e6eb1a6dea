"""Probe: a script that trains a model of its own through `scaletrain.train(config, spec=...)`,
as a user's would. `--spec script` hands train the function defined here (in __main__: the
run records model.spec=__main__:make_spec), `--spec module` examples/gpt2's gpt2.make_spec
(on PYTHONPATH). Run again with more steps, it resumes the run; with --eval-data it then
evaluates the run's newest checkpoint from this script (scaletrain.evaluate). Each rank
writes OUT/rank<R>.json: what the API returned."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import gpt2

import scaletrain


def make_spec(vocab_size: int, **kwargs):  # this script's own model: gpt2's, built by name from here
    return gpt2.make_spec(vocab_size, **kwargs)


p = argparse.ArgumentParser()
p.add_argument("--out", type=Path, required=True)
p.add_argument("--spec", choices=["script", "module"], required=True)
p.add_argument("--eval-data")
p.add_argument("overrides", nargs="*")
args = p.parse_args()

summary = scaletrain.train([], args.overrides, spec=make_spec if args.spec == "script" else gpt2.make_spec)
got: dict = {"summary": {k: str(v) if isinstance(v, Path) else v for k, v in vars(summary).items()}}
if args.eval_data:
    got["eval"] = scaletrain.evaluate(summary.run_dir, [f"eval.data={args.eval_data}", "eval.batches=1"])
(args.out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(got))
