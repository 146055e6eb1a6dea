"""Acceptance: a run moves between world sizes and between DeepSpeed and FSDP2 mid-training,
with its optimizer state and its exact data position, and each move verifies itself.

Each chain is one run directory trained 2 steps at a time, every link on another layout: a
link is killed right after its checkpoint (what a preempted job leaves), the next resumes it
on the next layout (resharded natively for DCP, converted through the neutral state for
DeepSpeed, verified tensor by tensor either way). The whole 10 steps must equal one process
trained straight through on the same global batch of 6 (divisible by 1, 2 and 3): loss and
grad norm every step and final weights, with the tolerances of every equivalence test
(helpers.py). A move that lost the optimizer moments, reset the step count or skipped or
repeated samples changes the next step's loss by far more than that (planted: see
docs/testing.md).
"""

from __future__ import annotations

import pytest

from helpers import assert_same_training, base_overrides, check, metric_rows, train

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

GLOBAL_BATCH = 6
# (strategy, world size) of each link of 2 steps.
CHAINS = {
    # fsdp 2 -> 3 -> 2 (uneven shards: the reported case) -> zero2 at 2 -> zero2 at 1
    "fsdp_to_zero2": [("fsdp", 2), ("fsdp", 3), ("fsdp", 2), ("zero2", 2), ("zero2", 1)],
    # zero3 2 -> 3 -> 1 -> 2, then fsdp at 2
    "zero3_to_fsdp": [("zero3", 2), ("zero3", 3), ("zero3", 1), ("zero3", 2), ("fsdp", 2)],
}


@pytest.fixture(scope="module")
def reference6(small_dataset, tmp_path_factory):
    run = tmp_path_factory.mktemp("reference6") / "run"
    check(train([*base_overrides(small_dataset, run), f"train.micro_batch={GLOBAL_BATCH}"]))
    return run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("chain", list(CHAINS))
def test_run_moves_between_world_sizes_and_engines(small_dataset, reference6, tmp_path, chain):
    run = tmp_path / "run"
    links = CHAINS[chain]
    for i, (strategy, world) in enumerate(links):
        stop = 2 * (i + 1)
        args = [
            *base_overrides(small_dataset, run),
            f"parallel.strategy={strategy}",
            f"train.micro_batch={GLOBAL_BATCH // world}",
            "checkpoint.every=2",
        ]
        env = {"SCALETRAIN_KILL_AT": f"step:{stop}"} if i < len(links) - 1 else {}
        proc = train(args, nproc=world, env=env, timeout=240)
        if env:
            assert proc.returncode != 0 and (run / "checkpoints" / f"step_{stop}" / "COMPLETE").is_file(), proc.stderr[-2000:]
        else:
            check(proc)
        if i > 0:
            prev = links[i - 1]
            out = proc.stdout
            assert f"step_{stop - 2} ({prev[0]} at world {prev[1]})" in out and "; verified" in out, out[-2000:]
        assert [r["step"] for r in metric_rows(run)] == list(range(1, stop + 1))
    assert_same_training(run, reference6)
