"""Acceptance: crashes under elastic restarts and preemption lose nothing but time.

One job, as a scheduler would treat it: `scaletrain launch --max-restarts 3` loses a random
rank to kill -9 at a random step, twice (torchrun restarts the group, which resumes from
its newest checkpoint by itself), then the launcher gets SIGTERM (what Slurm or Kubernetes
send before they kill): every rank stops after the same step, saves there, and the
launcher exits with the documented code 75. The same command again completes the run,
which must equal the uninterrupted one bit for bit (the session's DDP world-2 run,
conftest.py). The seed and the faults are in every failure message.
"""

from __future__ import annotations

import random

import pytest

from scaletrain import checkpoint

from helpers.launch import check, scaletrain
from helpers.numerics import assert_bit_exact
from helpers.runs import base_overrides, eval_overrides, metric_rows

EXIT_PREEMPTED = 75  # documented in README.md and docs/checkpointing.md


@pytest.mark.e2e
@pytest.mark.serial  # signals against step timing
@pytest.mark.timeout(120)
def test_sigterm_to_a_single_process_run_saves_and_exits_75(small_dataset, tmp_path):
    run = tmp_path / "run"
    proc = scaletrain(["train", *base_overrides(small_dataset, run), "train.micro_batch=4"], env={"SCALETRAIN_KILL_AT": "term:3"})
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert "preempted (SIGTERM) at step 3: checkpoint saved" in proc.stderr
    assert [s for s, _ in checkpoint.complete_checkpoints(run / "checkpoints")] == [3]


@pytest.mark.dist
@pytest.mark.serial  # signals against step timing
@pytest.mark.timeout(500)
def test_kill_9_under_elastic_restarts_then_sigterm_then_resume_equals_the_straight_run(small_dataset, ddp2_run, tmp_path):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # Attempts 0 and 1 each lose a random rank to kill -9 at a random step past the last
    # attempt's; checkpoints every 2 steps, so each restart resumes up to a step before it.
    # Attempt 2 gets SIGTERM (to the launcher) after a later step: a preemption.
    s0 = rng.randint(2, 4)
    s1 = rng.randint(s0 + 1, 6)
    s2 = rng.randint(s1 + 1, 8)
    faults = f"step:{s0}@{rng.randrange(2)},step:{s1}@{rng.randrange(2)},term:{s2}"
    why = f"seed {seed}: SCALETRAIN_KILL_AT={faults}"
    run = tmp_path / "run"
    # Evaluated as the straight run is (steps 4, 8, 10): no evaluation lost or written twice
    # across the kills, restarts and the preemption.
    args = [*base_overrides(small_dataset, run), "train.micro_batch=2", "checkpoint.every=2", *eval_overrides(small_dataset)]
    launch = ["launch", "--nproc", "2", "--max-restarts", "3", *args]
    proc = scaletrain([*launch, "checkpoint.verify_on_start=true"], env={"SCALETRAIN_KILL_AT": faults}, timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, f"{why}\n{proc.stderr[-3000:]}"
    stopped = max(s for s, _ in checkpoint.complete_checkpoints(run / "checkpoints"))
    # The rank that sent SIGTERM waits for it to come back (faults.preempt_at), so the
    # one-step-late agreement (PreemptionWatch.agreed) stops every rank after step s2 + 1.
    assert stopped == s2 + 1 and len(metric_rows(run)) == stopped, why
    assert f"preempted (SIGTERM) at step {stopped}: checkpoint saved" in proc.stderr, f"{why}\n{proc.stderr[-3000:]}"
    # verify_on_start ran after the first step of the first and the last attempt (the middle
    # one may be killed at its first step, before it) and left nothing behind.
    assert proc.stdout.count("verify_on_start saved and reloaded step") >= 2, why
    assert not (run / "checkpoints" / ".verify_on_start").exists()
    check(scaletrain(launch))  # the same command again continues
    assert_bit_exact(run, ddp2_run, 10)
