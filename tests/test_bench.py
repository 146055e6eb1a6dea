"""`scaletrain bench`: the hand-written loops do the same work as scaletrain's (their losses
agree step for step), the peers run the same model, and the figures pair runs by round.
Timing itself is never asserted: the bench reports it (docs/benchmarks.md)."""

from __future__ import annotations

import json
import math

import pytest

from scaletrain.bench import Bench, Run
from scaletrain.bench.report import loss_gaps, summarize, write_docs
from scaletrain.bench.runner import PEERS, check_request
from scaletrain.bench.telemetry_overhead import per_step_cost
from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.errors import UserError
from scaletrain.strategies import STRATEGIES

from helpers.launch import check, one_line_error, scaletrain
from helpers.runs import base_overrides


def _run(variant: str, rnd: int, walls: list[float], losses: list[float] | None = None) -> Run:
    steps = 5 * len(walls)
    losses = losses or [8.0 - 0.1 * s for s in range(steps)]
    return Run(variant, "ddp", rnd, [[5, w] for w in walls], [[s + 1, v] for s, v in enumerate(losses)], 100 + rnd, 1000)


@pytest.mark.unit
def test_runs_are_paired_by_round_and_the_warmup_interval_is_left_out():
    bench = Bench(["ddp"], 2, 3, False, None, 512)  # type: ignore[arg-type]
    # Round r of scaletrain against round r of the raw loop.
    walls = {"scaletrain": [5.5, 9.0, 10.0], "raw": [5.0, 10.0, 10.0]}
    for rnd in range(3):
        for variant in ("raw", "scaletrain") if rnd % 2 else ("scaletrain", "raw"):
            bench.runs.append(_run(variant, rnd, [99.0, walls[variant][rnd]]))  # 99: the warm-up interval
    rows = {r["loop"]: r for r in summarize(bench)}
    assert rows["scaletrain"]["step_s"] == pytest.approx([1.1, 1.8, 2.0])  # 5 steps an interval
    # Paired: 1.1, 0.9 and 1.0; the medians' ratio would say 0.9.
    assert rows["scaletrain"]["ratio"] == pytest.approx([0.9, 1.0, 1.1]) and rows["scaletrain"]["vs"] == "raw"
    assert rows["raw"]["ratio"] is None
    assert rows["raw"]["tokens_per_s"] == pytest.approx([500, 500, 1000])
    assert rows["raw"]["peak_bytes"] == [100, 101, 102]
    # The last interval's mean loss, per-step losses or one per interval (HF Trainer).
    assert rows["raw"]["final_loss"] == pytest.approx(sum(8.0 - 0.1 * s for s in range(5, 10)) / 5)
    assert _run("hf-trainer", 0, [1.0, 1.0], [8.0, 7.5]).final_loss == 7.5


@pytest.mark.unit
def test_the_loss_gap_compares_the_same_steps():
    bench = Bench(["ddp"], 2, 1, False, None, 512)  # type: ignore[arg-type]
    bench.runs += [
        _run("scaletrain", 0, [1, 1]),
        _run("raw", 0, [1, 1], [8.0 - 0.1 * s + (0.25 if s == 7 else 0) for s in range(10)]),
    ]
    assert loss_gaps(bench) == {"ddp": pytest.approx(0.25)}


@pytest.mark.unit
def test_the_docs_keep_their_prose_around_the_generated_table(tmp_path):
    bench = Bench(["ddp"], 2, 1, False, None, 512)  # type: ignore[arg-type]
    bench.runs += [_run("scaletrain", 0, [1, 1.02]), _run("raw", 0, [1, 1.0])]
    summary = {
        "command": "scaletrain bench --strategies ddp",
        "machine": {
            "date": "2026-11-23",
            "cpu": "X",
            "cores": 2,
            "cpu_capability": "AVX2",
            "python": "3.11",
            "versions": {"torch": "2.13.0"},
        },
        "nproc": 2,
        "rounds": 1,
        "shape": "tiny",
        "rows": summarize(bench),
        "loss_gaps": loss_gaps(bench),
    }
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nprose before\n\n<!-- bench:start -->\nold table\n<!-- bench:end -->\n\nprose after\n")
    write_docs(doc, summary)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nprose before\n") and text.endswith("\n\nprose after\n")
    assert "old table" not in text and "| ddp | scaletrain |" in text and "1.020 (1.020-1.020) raw" in text
    assert (tmp_path / "benchmarks.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "strategies", "fragment"),
    [
        (["parallel.strategy=fsdp", "parallel.tp=2"], ["fsdp"], "do not mirror parallel.tp"),
        (["train.compile=true"], ["ddp"], "do not mirror train.compile"),
        (["train.steps=15", "train.log_every=10"], ["ddp"], "accepted: --steps of at least 20"),
        ([], ["ddp", "zero4"], "unknown ['zero4']"),
    ],
)
def test_what_the_raw_loops_cannot_mirror_is_refused_up_front(overrides, strategies, fragment):
    with pytest.raises(UserError) as e:
        check_request(load_config([], overrides), strategies, 2, 3)
    assert fragment in str(e.value)


@pytest.mark.unit
def test_the_peers_are_benchmarked_on_strategies_of_the_table():
    assert PEERS and set(PEERS) <= set(STRATEGIES)


def bench_cli(capsys, *args: str) -> tuple[int, list[str], str]:
    """`scaletrain bench ARGS` in this process: (exit code, stdout lines, stderr)."""
    code = main(["bench", *args])
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err


@pytest.mark.unit
def test_the_loops_suite_is_the_default_and_runs_in_alternating_order(capsys, tmp_path):
    code, lines, _ = bench_cli(capsys, "--strategies", "ddp,zero2", "--rounds", "2", "--out", str(tmp_path), "--dry-run")
    assert code == 0
    # scaletrain's runs end with their run.dir=, the raw loop's with their result file.
    assert [line.split()[-1].removeprefix("run.dir=").removeprefix(f"{tmp_path}/") for line in lines] == [
        "ddp/scaletrain-r1",
        "ddp/raw-r1/result.json",
        "ddp/raw-r2/result.json",
        "ddp/scaletrain-r2",
        "zero2/scaletrain-r1",
        "zero2/raw-r1/result.json",
        "zero2/raw-r2/result.json",
        "zero2/scaletrain-r2",
    ]
    assert all("--nproc-per-node=2" in line for line in lines)  # the default
    assert "-m scaletrain.bench.raw" in lines[1]


@pytest.mark.unit
@pytest.mark.parametrize("nproc, runner", [("1", "-m scaletrain train "), ("2", "-m scaletrain launch --nproc 2 ")])
def test_the_checkpoint_suite_runs_the_same_config_sync_then_async(capsys, tmp_path, nproc, runner):
    args = ["--suite", "checkpoint", "--nproc", nproc, "--out", str(tmp_path), "train.steps=20", "--dry-run"]
    code, lines, _ = bench_cli(capsys, *args)
    assert code == 0 and len(lines) == 2
    for line, mode in zip(lines, ("false", "true")):
        assert runner in line and "model.preset=small" in line and "train.steps=20" in line
        assert line.endswith(f"run.dir={tmp_path / f'async_{mode}'} checkpoint.async_save={mode} train.resume=never")
    assert lines[0].split("run.dir=")[0] == lines[1].split("run.dir=")[0]  # the same config in both modes


@pytest.mark.unit
def test_the_telemetry_suite_alternates_defaults_and_all_off(capsys, tmp_path):
    code, lines, _ = bench_cli(
        capsys, "--suite", "telemetry", "--rounds", "2", "--steps", "40", "--out", str(tmp_path), "--dry-run"
    )
    assert code == 0 and len(lines) == 4
    off = "telemetry.comm_sample_every=0 guards.weight_hash_every=0 guards.hang_timeout_s=0"
    assert [off in line for line in lines] == [True, False, True, False]
    assert all("-m scaletrain launch --nproc 2 " in line and "train.steps=40" in line for line in lines)  # --nproc's default
    assert [line.split("run.dir=")[1].split()[0] for line in lines] == [
        str(tmp_path / run) for run in ("off0", "defaults0", "off1", "defaults1")
    ]


@pytest.mark.unit
def test_the_recorder_cost_is_timed_in_process():
    assert 0 < per_step_cost(1000) < 1e-3  # seconds a step: microseconds in fact


@pytest.mark.unit
@pytest.mark.parametrize(
    "args, fragments",
    [
        (
            ["--suite", "checkpoint", "--peers", "--steps", "5"],
            ["--steps, --peers: not an option of --suite checkpoint", "accepted: --nproc, --out"],
        ),
        (["--suite", "telemetry", "--strategies", "ddp"], ["--strategies: not an option of --suite telemetry"]),
        (["--suite", "checkpoint", "checkpoint.every=20"], ["checkpoint.every=20, train.steps=30: fewer than 2 saves"]),
        (["--suite", "telemetry", "--steps", "15"], ["train.steps=15 gives fewer than 2 intervals", "at least 20"]),
        (["--suite", "telemetry", "train.nope=1"], ["unknown config key train.nope"]),
    ],
)
def test_a_suite_refuses_what_it_cannot_run_in_one_line(capsys, args, fragments):
    code, lines, err = bench_cli(capsys, *args, "--dry-run")
    assert code == 2 and not lines and err.count("\n") == 1 and err.startswith("scaletrain: error:")
    assert all(f in err for f in fragments), err


@pytest.mark.e2e
@pytest.mark.equivalence
@pytest.mark.timeout(240)
def test_the_raw_ddp_loop_trains_exactly_as_scaletrain_at_world_2(small_dataset, tmp_path):
    # Same model, initial weights, batches and arithmetic: DDP's all-reduce sums the two
    # ranks' gradients in the same order in both, clipping and AdamW are torch's. What can
    # differ is the gradient norm's summation (torch's foreach kernel or one norm per
    # tensor): an ulp or so of the clip factor. Over 6 steps that moves the loss (about 8)
    # by a few float32 ulps (1e-6 each), far below 1e-4; a raw loop whose ranks did not
    # reduce, or that scaled the loss otherwise, is off by 1e-2 or more by step 2.
    out = tmp_path / "bench"
    args = [*base_overrides(small_dataset, tmp_path / "unused", steps=6), "train.log_every=3", "train.micro_batch=2"]
    proc = check(
        scaletrain(
            [
                "bench",
                *args,
                "--strategies",
                "ddp",
                "--nproc",
                "2",
                "--rounds",
                "1",
                "--steps",
                "6",
                "--out",
                str(out),
                "--docs",
                str(tmp_path / "b.md"),
            ],
            timeout=200,
        )
    )
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["engine"], r["loop"]) for r in summary["rows"]] == [("ddp", "scaletrain"), ("ddp", "raw")]
    assert summary["loss_gaps"]["ddp"] < 1e-4
    runs = {r["variant"]: r for r in summary["runs"]}
    assert [s for s, _ in runs["raw"]["losses"]] == list(range(1, 7)) and runs["raw"]["intervals"][0][0] == 3
    assert runs["raw"]["losses"][-1][1] < runs["raw"]["losses"][0][1] - 0.05  # it trains
    ratio = summary["rows"][0]["ratio"][1]
    assert math.isfinite(ratio) and ratio > 0 and "step time ÷" in proc.stdout
    assert "| ddp | raw |" in (tmp_path / "b.md").read_text()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_peers_train_the_same_model(small_dataset, tmp_path):
    out = tmp_path / "bench"
    args = [*base_overrides(small_dataset, tmp_path / "unused", steps=4), "train.log_every=2", "train.micro_batch=2"]
    check(
        scaletrain(
            [
                "bench",
                *args,
                "--strategies",
                "ddp",
                "--nproc",
                "1",
                "--rounds",
                "1",
                "--steps",
                "4",
                "--peers",
                "--out",
                str(out),
            ],
            timeout=280,
        )
    )
    rows = {r["loop"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert set(rows) == {"scaletrain", "raw", "scaletrain-hf", "hf-trainer", "accelerate"}
    # The same initial weights and loss over other batches (the trainers shuffle their
    # own way): after 4 warm-up steps every loss is still near ln(512) = 6.24, within the
    # spread of batch losses (about 0.1); a model of another shape or init is not.
    for loop in ("hf-trainer", "accelerate"):
        assert abs(rows[loop]["final_loss"] - rows["scaletrain-hf"]["final_loss"]) < 0.15, rows
        assert rows[loop]["vs"] == "scaletrain-hf"


@pytest.mark.e2e
def test_a_bad_request_ends_in_one_line(tmp_path):
    proc = scaletrain(["bench", "--strategies", "ddp,zero9", "--out", str(tmp_path)])
    one_line_error(proc, "unknown ['zero9']", "accepted: ddp,fsdp,zero1,zero2,zero3")
