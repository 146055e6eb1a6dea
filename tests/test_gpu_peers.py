"""scripts/gpu_peers.py's CPU stand-in (issue 59): every path and every peer at a tiny shape, as the lent GPU runs them.

The device call only measures; what it runs is checked here first. One run of the script with --tiny (the
rows of the GPU command in order, on tiny shapes, Liger's GPU-only kernels left out): every row is in
results.jsonl and summary.md; each scaletrain row trained (its loss fell) and carries what `scaletrain
bench --suite clock-gpu` plans again (its command and measured step); each HF Trainer row trained the model
scaletrain trains (the same parameter count; with LoRA, PEFT's adapters on the same modules at the same
rank: the same trainable count as scaletrain's own LoRA run of that config); the torchtitan row trained
(torchtitan 0.3.0's own Llama-3 trainer through its CPU shims, from `make setup-test`'s .venv/torchtitan,
which TITAN_SITE puts on that row's path alone). Then --list names the GPU rows and the budget skips a
row that cannot fit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_peers.py"
# `make setup-test`: torchtitan and what its trainer imports, in a directory of its own (its datasets
# must not reach HF Trainer's rows).
TITAN = Path(__file__).resolve().parents[1] / ".venv" / "torchtitan"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("peers")
    env = {**os.environ, "TITAN_SITE": str(TITAN)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--tiny"], capture_output=True, text=True, timeout=1200, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return out, rows


def _trainable(config: Path) -> tuple[int, int]:
    """scaletrain's own model of a run's resolved config: (parameters, trainable ones)."""
    from scaletrain.config import load_config
    from scaletrain.models import model_spec

    cfg = load_config([str(config)])
    model = model_spec(cfg, 4096, 0).build_meta(cfg.data.seq_len)
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_every_row_runs_in_order(tiny: tuple[Path, list[dict]]) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_peers

    out, rows = tiny
    expected = [r.name for r in gpu_peers.runs(True) if "--liger" not in r.args]
    assert [r["name"] for r in rows] == expected
    summary = (out / "summary.md").read_text()
    assert all(f"| {name} |" in summary for name in expected)
    assert json.loads((out / "env.json").read_text())["device_name"] == "cpu"


def test_scaletrain_rows_train_and_can_be_planned_again(tiny: tuple[Path, list[dict]]) -> None:
    _, rows = tiny
    ours = [r for r in rows if r["who"] == "scaletrain"]
    assert len(ours) >= 8
    for r in ours:
        assert r["status"] == "PASS", r
        d = r["data"]
        losses = [loss for _, loss in d["losses"]]
        assert losses[-1] < losses[0], (r["name"], losses)  # six steps at lr 3e-4 (LoRA: its adapters) fall
        assert d["tokens_per_s"] > 0 and d["step_s"] > 0 and d["mem_peak_bytes"] > 0
        assert r["cmd"].startswith("scaletrain train ") and "run.dir=" in r["cmd"]  # what clock-gpu plans again


def test_hf_trainer_trains_the_model_scaletrain_trains(tiny: tuple[Path, list[dict]]) -> None:
    out, rows = tiny
    peers = {r["name"]: r for r in rows if r["who"] == "hf-trainer"}
    assert set(peers) == {"hf-trainer-compiled", "hf-trainer-peft"}
    for name, r in peers.items():
        assert r["status"] == "PASS", r
        params, trainable = _trainable(out / "work" / name / "config.yaml")
        assert r["data"]["params"] == params, name
        # LoRA: PEFT's adapters on every linear layer at rank 16 are exactly scaletrain's LoRA parameters.
        assert r["data"]["trainable"] == trainable, name
    assert peers["hf-trainer-peft"]["data"]["trainable"] < peers["hf-trainer-compiled"]["data"]["trainable"] / 5


def test_torchtitan_row_trains(tiny: tuple[Path, list[dict]]) -> None:
    _, rows = tiny
    (titan,) = [r for r in rows if r["who"] == "torchtitan"]
    assert TITAN.is_dir(), "torchtitan is not installed: `make setup-test` installs it into .venv/torchtitan"
    assert titan["status"] == "PASS", titan
    assert titan["data"]["device"] == "cpu" and titan["data"]["tokens_per_s"] > 0, titan


def test_list_and_budget(tmp_path: Path) -> None:
    listed = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--list"], capture_output=True, text=True, check=True)
    assert "scaletrain-default" in listed.stdout and "model.preset=1b" in listed.stdout and "train.stop_at=20" in listed.stdout
    assert "train.micro_batch" not in listed.stdout.splitlines()[0]  # the default row sets no performance key
    # A budget no row fits: every row skipped, each said, nothing run.
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "o"), "--budget", "10"], capture_output=True, text=True, check=True
    )
    rows = [json.loads(line) for line in (tmp_path / "o" / "results.jsonl").read_text().splitlines()]
    assert rows and all(r["status"] == "SKIP" for r in rows)
    assert "skipped" in proc.stdout


def test_a_peer_that_is_not_installed_fails_in_one_line_and_the_rest_goes_on(tmp_path: Path) -> None:
    # torchtitan's folder empty (a device without its wheels): its row fails saying what is
    # missing in one line; the row after it still runs.
    env = {**os.environ, "TITAN_SITE": str(tmp_path / "empty")}
    (tmp_path / "empty").mkdir()
    args = ["--tiny", "--only", "torchtitan-compiled", "--only", "scaletrain-default"]
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "o"), *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["name"]: r for r in map(json.loads, (tmp_path / "o" / "results.jsonl").read_text().splitlines())}
    titan = rows["torchtitan-compiled"]
    assert titan["status"] == "FAIL" and "\n" not in titan["error"] and "torchtitan" in titan["error"], titan
    assert rows["scaletrain-default"]["status"] == "PASS"
