"""Tiers, deadlines and the runs shared across test modules.

Every test belongs to one tier (a module-level `pytestmark` or its own marker):
  unit  no process group, no subprocess that trains: `pytest -m unit` takes under a minute
  dist  engines on several ranks (probes, runs compared with a reference)
  e2e   the CLI as a user runs it, asserting on what it writes
`equivalence` marks the tests that compare numbers between layouts or engines; `make
test-numerics` runs them again under another ATEN_CPU_CAPABILITY.
"""

from __future__ import annotations

import pytest

from scaletrain.launch.env import use_build_environment

from helpers.checklist import load_checklist
from helpers.launch import check, scaletrain, set_deadline, train
from helpers.runs import SMALL_CORPUS, base_overrides, cp_overrides, eval_overrides

# As the CLI does for its process: DeepSpeed's ops from the environment's cache, built by its
# ninja (launch/env.py), for the tests' own processes and the probes they start.
use_build_environment()

TIERS = ("unit", "dist", "e2e")


# The longest files go first, longest first: `make test` hands files to its two workers in
# collection order (xdist's own reorder, by number of tests, is off: the Makefile's
# --no-loadscope-reorder), and a long file at the end leaves the other core idle. Seconds
# per file measured on the whole suite (pytest --junitxml, 2026-11-28): 221, 92, 89 (mostly
# waiting: slowed steps, restarts), 85, 81, 78, 75 (mostly waiting), 72, 66, 62, 57, 56;
# every other file under 50.
FIRST = (
    "test_plan_measure.py",
    "test_readme.py",  # ~5 min alone (the demo's 300 steps): not last on a worker
    "test_gradients.py",
    "test_replica_groups.py",
    "test_moe.py",
    "test_ulysses.py",
    "test_launch.py",
    "test_checkpoint_store.py",
    "test_muon.py",
    "test_engine_deepspeed.py",
    "test_offload.py",
    "test_checkpoint_nodes.py",
    "test_object_store.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if len(tiers) != 1:
            raise pytest.UsageError(f"{item.nodeid}: needs exactly one tier marker of {TIERS}, has {tiers}")
    # Stable: each file's tests keep their order, the files after FIRST theirs.
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))


def pytest_runtest_setup(item):
    # Before any fixture of the test is set up (session fixtures included, which run inside
    # the first test that needs them): subprocesses are capped by what is left of this.
    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout"))
    set_deadline(limit)


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory):
    """A small corpus (three stdlib packages) prepared once per session, vocab 512."""
    out = tmp_path_factory.mktemp("shared-data") / "small"
    check(scaletrain(["data", "prepare", "--input", *SMALL_CORPUS, "--out", str(out), "--vocab-size", "512"]))
    return out


@pytest.fixture(scope="session")
def cp_straight(small_dataset, tmp_path_factory):
    """What the context-parallel runs equal: one process, fsdp, global batch 4 of 256 tokens,
    8 steps, evaluated at 4 and 8 (helpers/runs.py, cp_overrides)."""
    run = tmp_path_factory.mktemp("cp") / "straight"
    check(train(cp_overrides(small_dataset, run, "train.micro_batch=4", "parallel.strategy=fsdp")))
    return run


@pytest.fixture(scope="session")
def reference_run(small_dataset, tmp_path_factory):
    """One process, ddp, global batch 4, 10 fp32 steps, a checkpoint every 5, evaluated
    at steps 4, 8 and 10 (helpers/runs.py, eval_overrides): what every engine at world 2 (2 ranks x
    micro-batch 2, or 2 x 1 x 2 accumulated) must reproduce."""
    run = tmp_path_factory.mktemp("reference") / "ddp"
    check(
        train([*base_overrides(small_dataset, run), "train.micro_batch=4", "checkpoint.every=5", *eval_overrides(small_dataset)])
    )
    return run


@pytest.fixture(scope="session")
def ddp2_run(small_dataset, tmp_path_factory):
    """DDP at world 2 (2 x 2), same global batch as the reference, a checkpoint every 5."""
    run = tmp_path_factory.mktemp("ddp2") / "run"
    check(
        train(
            [*base_overrides(small_dataset, run), "train.micro_batch=2", "checkpoint.every=5", *eval_overrides(small_dataset)],
            nproc=2,
        )
    )
    return run


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1 (tests/s3_server.py), for this test process."""
    from s3_server import start_server

    s3 = start_server()
    yield s3
    s3.server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, request):
    """The server with a fresh bucket, its credentials and endpoint in the environment (the
    runs this test starts inherit them)."""
    import hashlib

    from s3_server import with_bucket

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return with_bucket(s3_server, f"test-{hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]}")


@pytest.fixture
def checklist(monkeypatch):
    """scripts/gpu_checklist.py as a module, its knobs at their defaults (test_gpu_checklist*.py)."""
    return load_checklist(monkeypatch)
