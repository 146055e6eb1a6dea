"""Config: merge order, typed dotted overrides, and one-line errors that name key, value and what is accepted."""

import subprocess
import sys

import pytest

from scaletrain.config import load_config, split_args
from scaletrain.errors import UserError


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_validate_and_round_trip_through_yaml(tmp_path):
    cfg = load_config()
    again = load_config([write(tmp_path, "resolved.yaml", cfg.to_yaml())])
    assert again == cfg


def test_files_merge_in_order_then_overrides_win(tmp_path):
    a = write(tmp_path, "a.yaml", "train:\n  lr: 0.1\n  steps: 7\nmodel:\n  preset: small\n")
    b = write(tmp_path, "b.yaml", "train:\n  lr: 0.2\n")
    cfg = load_config([a, b], ["train.warmup_steps=3", "data.paths=corpus/*.txt", "precision=bf16"])
    assert cfg.train.lr == 0.2  # later file wins
    assert cfg.train.steps == 7  # untouched key from the earlier file survives the deep merge
    assert cfg.model.preset == "small"
    assert cfg.train.warmup_steps == 3 and isinstance(cfg.train.warmup_steps, int)
    assert cfg.data.paths == ["corpus/*.txt"]  # one path becomes a list
    assert cfg.precision == "bf16"
    cfg = load_config([a], ["train.lr=3e-4"])  # YAML 1.1 reads 3e-4 as text; the schema makes it a float
    assert cfg.train.lr == pytest.approx(3e-4)


def test_split_args_sorts_files_from_overrides():
    assert split_args(["a.yaml", "x.y=1", "b.yml"]) == (["a.yaml", "b.yml"], ["x.y=1"])
    with pytest.raises(UserError, match="neither a CONFIG.yaml"):
        split_args(["train.steps"])


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("train.lrr=1", ["train.lrr", "did you mean train.lr", "accepted keys in train"]),
        ("bogus.key=1", ["bogus", "accepted keys in the top level", "train"]),
        ("train.lr=abc", ["train.lr", "'abc'", "number"]),
        ("train.steps=0", ["train.steps", "0", ">= 1", "greater than or equal to 1"]),
        ("precision=fp8", ["precision", "'fp8'", "'fp32', 'bf16' or 'fp16'"]),
        ("model.preset=huge", ["model.preset", "'huge'", "'tiny'"]),
        ("train.micro_batch=2.5", ["train.micro_batch", "2.5", "integer"]),
        ("precision.mode=x", ["precision = {'mode': 'x'}", "'fp32', 'bf16' or 'fp16'"]),
        ("=3", ["section.key=value"]),
    ],
)
def test_bad_values_name_key_value_and_accepted(override, fragments):
    with pytest.raises(UserError) as err:
        load_config([], [override])
    message = str(err.value)
    assert "\n" not in message
    found = [f for f in fragments if f in message]
    assert found, f"none of {fragments} in {message!r}"
    assert override.split("=")[0].split(".")[0] in message or "section.key" in message


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config([str(tmp_path / "missing.yaml")])
    with pytest.raises(UserError, match=r"bad.yaml.* is not valid YAML at line \d"):
        load_config([write(tmp_path, "bad.yaml", "train:\n  lr: [1,\n")])
    with pytest.raises(UserError, match="precision is a value, not a section"):
        load_config([write(tmp_path, "p.yaml", "precision: bf16\n")], ["precision.mode=x"])
    with pytest.raises(UserError, match="must hold a mapping"):
        load_config([write(tmp_path, "list.yaml", "- 1\n- 2\n")])


def test_cli_error_is_one_line_exit_2_without_traceback(tmp_path):
    cases = [
        ["train", "train.steps=-5"],
        ["train", str(tmp_path / "nope.yaml")],
        ["train", "parallel.strategy=magic"],
        ["train", f"data.paths={tmp_path}/none/*.txt", f"run.dir={tmp_path}/run", "run.device=cpu"],
    ]
    for argv in cases:
        proc = subprocess.run([sys.executable, "-m", "scaletrain", *argv], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("scaletrain: error:"), proc.stderr


def test_print_config_shows_resolved_values():
    proc = subprocess.run(
        [sys.executable, "-m", "scaletrain", "train", "--print-config", "train.steps=42"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "steps: 42" in proc.stdout
