"""`scaletrain verify RUN` (training/verify.py): N steps re-run from a checkpoint and compared
with what the run recorded: the same bit for bit on the run's layout, within the engines'
equivalence tolerances on another world size; an edited record is named by its step."""

from __future__ import annotations

import json
import shutil

import pytest

from scaletrain.training.verify import Difference, compare

from helpers.launch import check, one_line_error, scaletrain, train
from helpers.runs import base_overrides

# A checkpoint every 5 of 10 steps, an evaluation every 5 on the training corpus itself.
COMMON = ["train.micro_batch=2", "checkpoint.every=5", "eval.every=5", "eval.batches=2"]


@pytest.fixture(scope="module")
def ddp_run(small_dataset, tmp_path_factory):
    run = tmp_path_factory.mktemp("verify") / "ddp"
    check(train([*base_overrides(small_dataset, run), *COMMON, f"eval.data={small_dataset}"]))
    return run


def verify(run, *args, **kw):
    return scaletrain(["verify", str(run), *args], **kw)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_clean_run_verifies_bit_for_bit_and_an_edited_record_fails_at_its_step(ddp_run, tmp_path):
    # Without --from: the newest checkpoint with recorded steps after it (step 10's is the last step).
    same = check(verify(ddp_run, "--scratch", str(tmp_path / "a")))
    assert "steps 6-10" in same.stdout and "bit for bit" in same.stdout and "verify: the same" in same.stdout
    # One loss of the record changed in its 6th significant digit: exit 1, that step named.
    edited = tmp_path / "edited"
    shutil.copytree(ddp_run, edited)
    rows = [json.loads(line) for line in (edited / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r["step"] == 8 and "event" not in r)
    row["loss"] = float(f"{row['loss']:.6g}") + 10 ** (len(str(int(row["loss"]))) - 6)
    (edited / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    differs = verify(edited, "--from", "5")
    assert differs.returncode == 1, differs.stdout + differs.stderr
    assert "verify: differs from step 8: step 8: loss" in differs.stdout and "relative" in differs.stdout
    assert "step 9" not in differs.stdout  # only the edited figure


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_two_ranks_verify_a_one_process_run_within_the_tolerances(ddp_run, tmp_path):
    """N -> M: the global batch kept (1 sequence per rank per micro-batch), the numbers then
    differing by summation order only."""
    two = check(verify(ddp_run, "--from", "5", "--steps", "3", "--nproc", "2", "--scratch", str(tmp_path / "two")))
    assert "steps 6-8" in two.stdout and "on 2 rank(s)" in two.stdout and "within the tolerances" in two.stdout
    assert "verify: the same" in two.stdout


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_zero2_run_on_two_ranks_verifies(small_dataset, tmp_path):
    run = tmp_path / "zero2"
    check(
        train(
            [
                *base_overrides(small_dataset, run, steps=8),
                "train.micro_batch=1",
                "checkpoint.every=4",
                "parallel.strategy=zero2",
            ],
            nproc=2,
        )
    )
    out = check(verify(run, "--steps", "3", "--from", "4"))
    assert "on 2 rank(s) (the same layout: bit for bit)" in out.stdout and "verify: the same: 3 steps" in out.stdout


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_run_whose_checkpoints_are_in_object_storage_verifies(small_dataset, s3, tmp_path):
    run = tmp_path / "stored"
    url = s3.url("ckpts")
    check(
        train(
            [*base_overrides(small_dataset, run, steps=8), "train.micro_batch=2", "checkpoint.every=4", f"checkpoint.dir={url}"]
        )
    )
    shutil.rmtree(run / "checkpoints")  # the machine that trained it is gone; the store has them
    out = check(verify(run, "--from", "4", "--steps", "2"))
    assert "verify: the same: 2 steps" in out.stdout and "fetched" in out.stdout
    assert sorted(p.rsplit("/", 1)[-1] for p in s3.fs().ls(f"{s3.bucket}/ckpts")) == ["step_4", "step_8"]  # nothing written there


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_bad_inputs_are_one_line(ddp_run, tmp_path):
    one_line_error(verify(tmp_path), "is not a run directory", "accepted: a run.dir")
    one_line_error(
        verify(ddp_run, "--from", "7"), "no complete checkpoint with recorded steps after it at step 7", "accepted: --from 5"
    )
    one_line_error(verify(ddp_run, "--from", "10"), "at step 10", "accepted: --from 5")  # the last step: nothing after it
    one_line_error(verify(ddp_run, "--steps", "0"), "--steps 0", "accepted: an integer >= 1")
    one_line_error(verify(ddp_run, "--from", "5", "--nproc", "3"), "does not split over 3 data-parallel ranks")


@pytest.mark.unit
def test_the_comparison_is_exact_on_one_layout_and_within_tolerances_across():
    recorded = [{"step": 1, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": 128}, {"step": 1, "event": "eval", "loss": 4.0}]
    near = [{"step": 1, "loss": 5.0 * (1 + 1e-6), "grad_norm": 1.0 * (1 + 1e-3), "lr": 1e-3, "tokens": 128},
            {"step": 1, "event": "eval", "loss": 4.0}]  # fmt: skip
    assert [d.what for d in compare(recorded, near, range(1, 2), exact=True)] == ["loss", "grad norm"]
    assert compare(recorded, near, range(1, 2), exact=False) == []
    far = [{**near[0], "loss": 5.01}, {"step": 1, "event": "eval", "loss": 4.01}]
    assert [d.what for d in compare(recorded, far, range(1, 2), exact=False)] == ["loss", "eval loss"]
    missing = compare(recorded, [], range(1, 2), exact=True)
    assert missing == [Difference(1, "the step's row", "present", "absent")]
