"""Config: merge order, typed dotted overrides, and one-line errors that name key, value and what is accepted."""

import pytest

from scaletrain.config import load_config, split_args
from scaletrain.errors import UserError

pytestmark = pytest.mark.unit


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


# Each bad value: the one line must name the key, the value given and what is accepted.
BAD_VALUES = [
    # (override, key, value as shown, accepted)
    ("train.lrr=1", "train.lrr", "train.lrr", "accepted keys in train: steps, micro_batch"),
    ("bogus.key=1", "bogus", "bogus", "accepted keys in the top level: model, data, train"),
    ("train.lr=abc", "train.lr", "'abc'", "expected a valid number"),
    ("train.steps=0", "train.steps", "= 0", "expected a value greater than or equal to 1"),
    ("precision=fp8", "precision", "'fp8'", "expected 'fp32', 'bf16' or 'fp16'"),
    (
        "model.preset=huge",
        "model.preset",
        "'huge'",
        "'tiny', 'small', '1b', '7b', '8b', '70b', '405b', 'tiny-moe', 'mixtral-8x7b', 'deepseek-moe-16b' or 'qwen3-moe-30b-a3b'",
    ),
    ("train.micro_batch=2.5", "train.micro_batch", "2.5", "an integer >= 1, or auto"),
    ("train.micro_batch=0", "train.micro_batch", "0", "an integer >= 1, or auto"),
    ("train.micro_batch=auto", "train.micro_batch", "auto", "train.global_batch=N"),
    ("precision.mode=x", "precision", "{'mode': 'x'}", "expected 'fp32', 'bf16' or 'fp16'"),
    ("parallel.strategy=magic", "parallel.strategy", "'magic'", "'ddp', 'fsdp', 'zero1', 'zero2', 'zero3' or 'auto'"),
    ("train.loss_scale_init=1000", "train.loss_scale_init", "1000", "accepted: 1, 2, 4, ..."),
    ("parallel.offload_optimizer=cpu", "parallel.offload_optimizer", "=cpu", "needs strategy zero1, zero2 or zero3, not ddp"),
    ("parallel.tp=2", "parallel.tp", "=2", "needs parallel.strategy=fsdp"),
    ("parallel.pp=4", "parallel.pp", "=4", "needs parallel.strategy=fsdp"),
    ("parallel.cp=3", "parallel.cp", "=3", "data.seq_len=128 does not divide; accepted: data.seq_len a multiple of 6"),
    ("parallel.pp_schedule=chimera", "parallel.pp_schedule", "'chimera'", "'gpipe', '1f1b', 'interleaved_1f1b'"),
    ("train.lr_scaling=sqrt", "train.lr_scaling", "=sqrt", "needs train.lr_base_batch"),
    ("=3", "section.key=value", "'=3'", "e.g. train.lr=3e-4"),
]


@pytest.mark.parametrize("override, key, value, accepted", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_name_key_value_and_accepted(override, key, value, accepted):
    with pytest.raises(UserError) as err:
        load_config([], [override])
    message = str(err.value)
    assert "\n" not in message
    missing = [f for f in (key, value, accepted) if f not in message]
    assert not missing, f"{missing} not in {message!r}"


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config([str(tmp_path / "missing.yaml")])
    with pytest.raises(UserError, match=r"bad.yaml.* is not valid YAML at line \d"):
        load_config([write(tmp_path, "bad.yaml", "train:\n  lr: [1,\n")])
    with pytest.raises(UserError, match="precision is a value, not a section"):
        load_config([write(tmp_path, "p.yaml", "precision: bf16\n")], ["precision.mode=x"])
    with pytest.raises(UserError, match="must hold a mapping"):
        load_config([write(tmp_path, "list.yaml", "- 1\n- 2\n")])
