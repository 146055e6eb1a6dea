"""Chaos on the newest layouts (issue 58 item 5): kill -9 at random moments of runs under
`scaletrain launch --max-restarts`, as tests/test_recovery.py does for DDP: Ulysses context
parallel on ZeRO-3, Muon on FSDP2, and FSDP2 with its checkpoints copied to object storage.
Each killed job completes by itself and equals the run never killed bit for bit (every
step's figures, every evaluation, every weight); in the store, no checkpoint lacks its
marker. The kill points: after a step (`step`), inside a save before its marker (`save`),
and, with a store, inside the copy before the store's marker (`upload`); the seed and the
faults are in every failure message."""

from __future__ import annotations

import os
import random

import pytest

from scaletrain import checkpoint

from helpers.launch import check, scaletrain, train
from helpers.numerics import assert_bit_exact
from helpers.runs import base_overrides, eval_overrides

STEPS, EVERY = 8, 2
LAYOUTS = {
    "ulysses-cp2-zero3": ["parallel.strategy=zero3", "parallel.cp=2", "parallel.cp_mode=ulysses", "train.micro_batch=2"],
    "muon-fsdp": ["parallel.strategy=fsdp", "train.optimizer=muon", "train.micro_batch=1"],
    "fsdp-store": ["parallel.strategy=fsdp", "train.micro_batch=1"],
}


def _faults(rng: random.Random, points: tuple[str, ...]) -> str:
    """Two kills in two attempts, each at a random point and rank, the second at a later step
    than the first (a restart resumes up to EVERY - 1 steps before its kill); `save` and
    `upload` at a step that has a checkpoint, where they fire."""
    kills, after = [], 1
    for last in (4, STEPS - 1):
        point = rng.choice(points)
        steps = [s for s in range(after + 1, last + 1) if point == "step" or s % EVERY == 0]
        step = rng.choice(steps)
        kills.append(f"{point}:{step}@{rng.randrange(2)}")
        after = step
    return ",".join(kills)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kill_9_at_random_moments_loses_nothing(layout, small_dataset, tmp_path, request):
    store = request.getfixturevalue("s3") if layout.endswith("store") else None
    seed = int(os.environ.get("SCALETRAIN_CHAOS_SEED") or random.randrange(1 << 30))  # set: a failure again
    rng = random.Random(seed)
    points = ("step", "save", "upload") if store else ("step", "save")
    faults = _faults(rng, points)
    why = f"{layout}, seed {seed}: SCALETRAIN_KILL_AT={faults}"
    common = [f"checkpoint.every={EVERY}", *eval_overrides(small_dataset, every=4), *LAYOUTS[layout]]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    check(train([*base_overrides(small_dataset, straight, steps=STEPS), *common], nproc=2))
    args = [*base_overrides(small_dataset, killed, steps=STEPS), *common]
    if store:
        args.append(f"checkpoint.dir={store.url('ckpts')}")
    proc = scaletrain(["launch", "--nproc", "2", "--max-restarts", "3", *args], env={"SCALETRAIN_KILL_AT": faults}, timeout=500)
    assert proc.returncode == 0, f"{why}\n{proc.stderr[-3000:]}"
    # Three starts (each prints the banner): two kills, two restarts, each from its newest complete checkpoint.
    assert proc.stdout.count("scaletrain model tiny:") == 3, f"{why}\n{proc.stdout[-3000:]}"
    try:
        assert_bit_exact(killed, straight, STEPS)
    except AssertionError as e:
        raise AssertionError(f"{why}: {e}") from None
    assert [s for s, _ in checkpoint.complete_checkpoints(killed / "checkpoints")][-1] == STEPS, why
    if store:
        fs = store.fs()
        for step_dir in fs.ls(f"{store.bucket}/ckpts"):
            assert fs.exists(f"{step_dir}/{checkpoint.MARKER}"), f"{why}: {step_dir} in the store without its marker"
