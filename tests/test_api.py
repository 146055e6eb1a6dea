"""scaletrain as a library (api.py, docs/api.md): an import that changes nothing in the
process, and a 2-rank program that trains, plans and evaluates through the API, under the
launcher's process group and under its own, training exactly as `scaletrain train` does;
and `train(config, spec=make_spec)`: a model of one's own handed over as its function, recorded
under its import string, resumed from it, refused in one line where no string can name it."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers.launch import check, one_line_error, probe, run, scaletrain
from helpers.numerics import LOSS_RTOL, assert_same_training
from helpers.runs import base_overrides, eval_overrides, eval_rows, final_weights, metric_rows

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt2"
# A model of one's own (models/module_spec.py), examples/gpt2's: its module on every process's path.
ENV = {"PYTHONPATH": os.pathsep.join([str(EXAMPLE), os.environ.get("PYTHONPATH", "")])}
SPEC_ARGS = {"dim": 16, "layers": 2, "heads": 2, "max_len": 64}

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
def test_load_config_takes_paths_strings_and_a_mapping(tmp_path, monkeypatch):
    import scaletrain

    monkeypatch.chdir(tmp_path)  # where the default run.dir (runs/...) would be written
    (tmp_path / "a.yaml").write_text("train:\n  steps: 7\n  lr: 0.001\n")
    from_strings = scaletrain.load_config(tmp_path / "a.yaml", ["train.lr=2e-3", "model.preset=small"])
    from_mapping = scaletrain.load_config([str(tmp_path / "a.yaml")], {"train.lr": 2e-3, "model.preset": "small"})
    assert from_strings == from_mapping
    assert (from_strings.train.steps, from_strings.train.lr, from_strings.model.preset) == (7, 2e-3, "small")
    with pytest.raises(scaletrain.UserError, match="config key train.steps = 0 is invalid"):
        scaletrain.load_config(overrides={"train.steps": 0})
    with pytest.raises(scaletrain.UserError, match="overrides go with YAML paths"):
        scaletrain.train(from_strings, ["train.steps=1"])
    # None is the embedded default as () is; what the docs do not show is one line naming what is accepted.
    assert scaletrain.load_config(None, {"train.lr": 2e-3}) == scaletrain.load_config((), {"train.lr": 2e-3})
    with pytest.raises(scaletrain.UserError, match=r"^the config's paths are dict \(a dict of values goes in the overrides"):
        scaletrain.train({"not": "a config"})
    with pytest.raises(scaletrain.UserError, match=r"^the config's paths are int; accepted: a YAML path"):
        scaletrain.plan(3)
    with pytest.raises(scaletrain.UserError, match=r"^the overrides are int; accepted: a dict"):
        scaletrain.load_config((), 5)
    with pytest.raises(scaletrain.UserError, match=r"^the overrides are list; accepted"):
        scaletrain.load_config((), ["train.lr=1", 2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.yaml"]  # nothing written


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", ["launcher", "caller"])
def test_a_two_rank_program_trains_plans_and_evaluates_through_the_api(small_dataset, reference_run, tmp_path, group):
    """The same 10 steps as the one-process reference, by ddp on 2 ranks from a script:
    what a correct engine at world 2 guarantees (helpers.numerics.assert_same_training), and the API
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


# ---------------------------------------------------------------------------- train(config, spec=...)


@pytest.fixture
def gpt2(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import gpt2

    return gpt2


def make_nothing(vocab_size):  # a top-level function of this module: nameable, as test_api:make_nothing
    raise AssertionError("a refused call builds no model")


@pytest.mark.unit
def test_a_spec_no_import_string_names_or_one_the_config_contradicts_is_one_line(gpt2, tmp_path):
    import scaletrain

    def nested(vocab_size):
        return gpt2.make_spec(vocab_size)

    model = ["model.source=python", "model.spec=gpt2:make_spec"]
    for config, spec, says in [
        ([], lambda vocab_size: None, "spec=test_api.test_a_spec_no_import_string_names_or_one_the_config_contradicts_is_one_line."
         "<locals>.<lambda> is a lambda or a function defined inside another: no import string names it"),
        ([], nested, ".<locals>.nested is a lambda or a function defined inside another"),
        ([], gpt2.GPT.forward, "spec=gpt2.GPT.forward is not at its module's top level"),
        ([], "gpt2:make_spec", "spec='gpt2:make_spec' is a string; accepted: the function itself (spec=make_spec)"),
        ([], 3, "spec= is of type int, not a function an import string can name; accepted: a function defined at the top level"),
        ([], gpt2.make_spec(512), "spec= is a ModuleSpec(...) itself, which a checkpoint cannot name; accepted: the function"),
        (["model.source=hf", "model.hf_config={model_type: llama}"], gpt2.make_spec,
         "spec=gpt2:make_spec is a model of your own, and model.source=hf names another; accepted: spec= with "
         "model.source=builtin (the default) or python, or model.source=hf without spec="),
        (model, make_nothing,
         "model.spec=gpt2:make_spec does not name spec=test_api:make_nothing; accepted: model.spec naming that function"),
        (["model.dim=64"], gpt2.make_spec, "model.dim does not apply to a model of your own; accepted: its arguments in "
         "model.spec_args"),
    ]:  # fmt: skip
        for paths, overrides in [([], config), (scaletrain.load_config(overrides=config), [])]:  # overrides, or a Config
            with pytest.raises(scaletrain.UserError) as e:
                scaletrain.train(paths, overrides, spec=spec)
            assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.unit
def test_spec_names_itself_in_the_config_or_keeps_the_configs_name_for_it(gpt2, tmp_path, monkeypatch):
    import scaletrain
    from scaletrain.api import _config

    # The default source, its spec_args given beside spec= (model.spec_args alone is no config: load_config refuses it).
    cfg = _config([], {"model.spec_args": SPEC_ARGS, "train.steps": 3}, gpt2.make_spec)
    assert (cfg.model.source, cfg.model.spec, cfg.model.spec_args, cfg.train.steps) == ("python", "gpt2:make_spec", SPEC_ARGS, 3)
    # A Config: the keys it was given stay the only ones given (training/defaults.py fills the others on a GPU).
    given = _config(scaletrain.load_config(overrides={"train.steps": 3}), (), gpt2.make_spec)
    assert (given.model.source, given.model.spec, given.train.steps) == ("python", "gpt2:make_spec", 3)
    assert given.model_fields_set == {"model", "train"} and given.model.model_fields_set == {"source", "spec"}
    # The config names the function already, by its module or by another that holds it too: its own string stays.
    (tmp_path / "models_here.py").write_text("from gpt2 import make_spec\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("gpt2:make_spec", "models_here:make_spec"):
        assert _config([], ["model.source=python", f"model.spec={spec}"], gpt2.make_spec).model.spec == spec
    assert _config([], ["model.source=python"], gpt2.make_spec).model.spec == "gpt2:make_spec"  # model.spec from spec=


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["module", "script"])
def test_train_with_a_spec_records_its_import_string_and_resumes_from_it(small_dataset, tmp_path, where):
    """`train(config, spec=make_spec)` trains 4 of 6 steps (train.stop_at) and records the
    function's import string; the same script run again resumes from the checkpoint,
    rebuilding the model from the string, to step 6, equal bit for bit to the 6 steps run
    straight (the wrong weights restored would differ: a resume is exact), and evaluates it.
    The CLI imports a module's function again (eval: the script's own evaluation); a
    script's own (__main__) it cannot, in one line."""
    run_dir = tmp_path / "run"

    def overrides(steps: int, where_to: Path = run_dir) -> list[str]:
        base = [o for o in base_overrides(small_dataset, where_to, steps) if not o.startswith("model.")]
        return [*base, f"model.spec_args={json.dumps(SPEC_ARGS)}", "train.micro_batch=2"]

    (first,) = probe("api_spec", ["--spec", where, *overrides(6), "train.stop_at=4"], tmp_path / "first", env=ENV, timeout=120)
    name = {"module": "gpt2:make_spec", "script": "__main__:make_spec"}[where]
    assert (first["summary"]["steps"], first["summary"]["steps_this_run"]) == (4, 4)
    saved = json.loads((run_dir / "checkpoints" / "step_4" / "trainer.json").read_text())
    assert saved["model"] == {"source": "python", "spec": name, "spec_args": SPEC_ARGS, "vocab_size": 512}
    for config in (run_dir / "config.yaml", run_dir / "checkpoints" / "step_4" / "config.yaml"):
        model = yaml.safe_load(config.read_text())["model"]
        assert (model["source"], model["spec"], model["spec_args"]) == ("python", name, SPEC_ARGS)

    args = ["--spec", where, "--eval-data", str(small_dataset), *overrides(6)]
    (second,) = probe("api_spec", args, tmp_path / "second", env=ENV, timeout=120)
    assert (second["summary"]["steps"], second["summary"]["steps_this_run"]) == (6, 2)  # resumed at step 4
    assert [r["step"] for r in metric_rows(run_dir)] == list(range(1, 7))
    assert second["eval"]["step"] == 6 and second["eval"]["loss"] > 0
    straight = tmp_path / "straight"
    probe("api_spec", ["--spec", where, *overrides(6, straight)], tmp_path / "third", env=ENV, timeout=120)
    figures = ("step", "loss", "grad_norm", "lr")
    assert [[r[k] for k in figures] for r in metric_rows(run_dir)] == [[r[k] for k in figures] for r in metric_rows(straight)]
    resumed, whole = final_weights(run_dir, 6), final_weights(straight, 6)
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in resumed)

    ckpt = run_dir / "checkpoints" / "step_6"
    cli = ["eval", str(ckpt), f"eval.data={small_dataset}", "eval.batches=1"]
    if where == "module":
        got = float(re.search(r"\(step 6\): loss (\S+)", check(scaletrain(cli, env=ENV)).stdout)[1])
        assert got == pytest.approx(second["eval"]["loss"], rel=1e-5)  # the same windows and weights
    else:
        proc = scaletrain(["ckpt", "convert", str(ckpt), str(tmp_path / "fsdp" / "step_6"), "--to", "fsdp"], env=ENV)
        one_line_error(proc, "model.spec='__main__:make_spec' names a function of the script that trained the model",
                       "accepted: that script (scaletrain.evaluate from it), or the function in a module on PYTHONPATH")  # fmt: skip
