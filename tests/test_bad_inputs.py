"""Bad inputs a fuzz of the newer features found (issue 58 item 4): each is one line, exit 2,
and leaves nothing written (a run directory the start made is removed again when empty)."""

from __future__ import annotations

import pytest

from helpers.launch import one_line_error, scaletrain, train
from helpers.runs import base_overrides

pytestmark = pytest.mark.e2e


def refused(proc, run_dir, *fragments):
    line = one_line_error(proc, *fragments)
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))  # nothing written
    return line


@pytest.mark.timeout(120)
def test_a_store_url_without_a_bucket(small_dataset, tmp_path):
    run_dir = tmp_path / "deep" / "run"
    proc = train([*base_overrides(small_dataset, run_dir, steps=2), "checkpoint.dir=s3://"])
    refused(proc, tmp_path / "deep", "checkpoint.dir='s3://' names no bucket; accepted: s3://bucket/prefix")


@pytest.mark.timeout(120)
def test_a_group_limit_without_groups(small_dataset, tmp_path):
    run_dir = tmp_path / "run"
    proc = train([*base_overrides(small_dataset, run_dir, steps=2), "model.preset=tiny-moe", "model.moe.topk_groups=1"])
    refused(proc, run_dir, "model.moe.topk_groups=1 picks each token's best groups", "accepted: model.moe.groups=G")


@pytest.mark.timeout(60)  # well inside the 120 s that a retried failure would take
def test_object_storage_without_credentials_fails_at_once_naming_where_it_looked(tmp_path):
    run_dir = tmp_path / "run"
    # No credentials anywhere botocore looks (the variables unset, a home without ~/.aws), an
    # endpoint that is never reached: botocore refuses to sign before any request.
    env = {"HOME": str(tmp_path), "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    overrides = [*base_overrides(tmp_path / "unused", run_dir, steps=2), "data.paths=s3://bucket/shards"]
    line = refused(train(overrides, env=env), run_dir, "no credentials found", "AWS_ACCESS_KEY_ID", "~/.aws/credentials")
    assert "accepted: credentials in one of them" in line


@pytest.mark.timeout(120)
def test_a_model_module_with_a_syntax_error(small_dataset, tmp_path):
    (tmp_path / "broken_model.py").write_text("def make_spec(:\n    pass\n")
    run_dir = tmp_path / "run"
    overrides = [*base_overrides(small_dataset, run_dir, steps=2), "model.source=python", "model.spec=broken_model:make_spec"]
    refused(train(overrides, env={"PYTHONPATH": str(tmp_path)}), run_dir, f"{tmp_path / 'broken_model.py'}, line 1: ")


@pytest.mark.timeout(60)
def test_an_option_value_that_starts_with_a_dash(tmp_path):
    one_line_error(scaletrain(["plan", "--gpu-memory", "-3GiB"]), "--gpu-memory '-3GiB' is not a size")
    # Any other usage error is one line too, naming where the help is.
    one_line_error(scaletrain(["plan", "--nodes"]), "argument --nodes: expected one argument", "scaletrain plan --help")
