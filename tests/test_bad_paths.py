"""Every path a config names is checked before work starts: one line, exit code 2, no
traceback (run.dir, data.dir, model.path's config.json)."""

from __future__ import annotations

import pytest

from scaletrain.cli import main

pytestmark = pytest.mark.e2e


def one_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("scaletrain: error:") and "accepted:" in err[0], err
    return err[0]


@pytest.mark.parametrize(
    "where, says",
    [
        ("file", "run.dir={file} is a file, not a directory"),
        ("file/run", "run.dir={file}/run cannot be created: a part of it is a file, not a directory"),
        ("/proc/self/nothing/run", "run.dir=/proc/self/nothing/run cannot be created (No such file or directory"),
    ],
)
def test_a_run_dir_that_cannot_be_one_is_one_line(tmp_path, capsys, small_dataset, where, says):
    file = tmp_path / "file"
    file.write_text("not a directory\n")
    run_dir = where.replace("file", str(file)) if where.startswith("file") else where
    line = one_line(capsys, ["train", f"data.paths={small_dataset}", f"run.dir={run_dir}", "train.steps=1"])
    assert says.format(file=file) in line
    assert file.read_text() == "not a directory\n"  # nothing lost


def test_a_data_cache_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    line = one_line(capsys, ["train", f"data.dir={tmp_path / 'file' / 'cache'}", f"run.dir={tmp_path / 'run'}", "train.steps=1"])
    assert "data.dir=" in line and "cannot be created: a part of it is a file" in line


def test_a_model_dir_whose_config_is_not_json_is_one_line(tmp_path, capsys, small_dataset):
    pytest.importorskip("transformers")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{not json")
    argv = [
        "train",
        "model.source=hf",
        f"model.path={tmp_path / 'model'}",
        f"data.paths={small_dataset}",
        f"run.dir={tmp_path / 'run'}",
    ]
    line = one_line(capsys, argv)
    assert f"model.path: {tmp_path / 'model' / 'config.json'} is not a readable model config (Expecting property name" in line
