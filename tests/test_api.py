"""scaletrain as a library (api.py, docs/api.md): an import that changes nothing in the
process, and a 2-rank program that trains, plans and evaluates through the API, under the
launcher's process group and under its own, training exactly as `scaletrain train` does."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import LOSS_RTOL, assert_same_training, base_overrides, eval_overrides, eval_rows, metric_rows, probe, run

# What `import scaletrain` may load: the package, its API module and its errors; no torch,
# pydantic or YAML, and nothing else of scaletrain.
IMPORT_CHECK = """
import json, os, sys
os.environ.pop("TORCH_EXTENSIONS_DIR", None)  # set by the tests' own process (conftest): what an import would set
env, path = dict(os.environ), list(sys.path)
import scaletrain
print(json.dumps({
    "env_changed": sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)),
    "path_changed": path != sys.path,
    "heavy": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "pydantic", "yaml", "deepspeed")),
    "ours": sorted(m for m in sys.modules if m.startswith("scaletrain")),
    "api": [n for n in ("load_config", "plan", "train", "evaluate", "RunSummary", "UserError") if hasattr(scaletrain, n)],
}))
"""


@pytest.mark.unit
def test_importing_scaletrain_changes_nothing_in_the_process():
    # This environment is a virtual one with a ninja in it (make setup): where the old import
    # set TORCH_EXTENSIONS_DIR, so the check can fail.
    proc = run([sys.executable, "-c", IMPORT_CHECK], timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["env_changed"] == [] and not got["path_changed"]
    assert got["heavy"] == [] and got["ours"] == ["scaletrain", "scaletrain.api", "scaletrain.errors"]
    assert got["api"] == ["load_config", "plan", "train", "evaluate", "RunSummary", "UserError"]


@pytest.mark.unit
def test_load_config_takes_paths_strings_and_a_mapping(tmp_path):
    import scaletrain

    (tmp_path / "a.yaml").write_text("train:\n  steps: 7\n  lr: 0.001\n")
    from_strings = scaletrain.load_config(tmp_path / "a.yaml", ["train.lr=2e-3", "model.preset=small"])
    from_mapping = scaletrain.load_config([str(tmp_path / "a.yaml")], {"train.lr": 2e-3, "model.preset": "small"})
    assert from_strings == from_mapping
    assert (from_strings.train.steps, from_strings.train.lr, from_strings.model.preset) == (7, 2e-3, "small")
    with pytest.raises(scaletrain.UserError, match="config key train.steps = 0 is invalid"):
        scaletrain.load_config(overrides={"train.steps": 0})
    with pytest.raises(scaletrain.UserError, match="overrides go with YAML paths"):
        scaletrain.train(from_strings, ["train.steps=1"])


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", ["launcher", "caller"])
def test_a_two_rank_program_trains_plans_and_evaluates_through_the_api(small_dataset, reference_run, tmp_path, group):
    """The same 10 steps as the one-process reference, by ddp on 2 ranks from a script:
    what a correct engine at world 2 guarantees (helpers.assert_same_training), and the API
    returns the run's own figures, the same on every rank."""
    run_dir = tmp_path / "run"
    overrides = [
        *base_overrides(small_dataset, run_dir),
        *eval_overrides(small_dataset),
        "parallel.strategy=ddp",
        "train.micro_batch=2",
    ]
    ranks = probe("api_script", [*(["--caller-group"] if group == "caller" else []), *overrides], tmp_path / "out", nproc=2,
                  timeout=240)  # fmt: skip
    for r in ranks:  # each rank's own clock
        r["summary"].pop("elapsed_s"), r["eval"].pop("eval_s")
    assert ranks[0] == ranks[1]  # data, the same on every rank
    got = ranks[0]
    assert_same_training(run_dir, reference_run)
    rows, evals = metric_rows(run_dir), eval_rows(run_dir)
    s = got["summary"]
    assert (s["run_dir"], s["steps"], s["steps_this_run"]) == (str(run_dir), 10, 10)
    assert s["loss"] == rows[-1]["loss"] and s["eval_loss"] == evals[-1]["loss"]
    assert got["plan"] == {"chosen_strategy": "ddp", "world": 2}
    # The checkpoint of step 10 evaluated afresh: the run's own eval of step 10.
    assert got["eval"]["step"] == 10 and got["eval"]["loss"] == pytest.approx(evals[-1]["loss"], rel=LOSS_RTOL)
    if group == "caller":
        assert got["group_kept"] and got["all_reduce"] == 2.0
