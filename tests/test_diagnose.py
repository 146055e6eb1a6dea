"""`scaletrain diagnose` and `scaletrain compare` on synthetic run directories.

Each directory is written by hand (make_run) in the format of docs/telemetry.md: healthy by
default, with one knob per problem, so every rule is shown to fire on its problem and stay
silent on a healthy run. One e2e test renders the report in headless Chromium.
"""

from __future__ import annotations

import json
import math
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.diagnose import compare, diagnose, load_run, write_report

from helpers.browser import render_in_chromium
from helpers.launch import one_line_error, scaletrain

GiB = 1024**3
CAPACITY = 80 * GiB
PLOT_IDS = ("plot-loss", "plot-lr", "plot-throughput", "plot-breakdown", "plot-memory")
STEP_S = 1.0
OTHER_S = 0.05


def compute_phases(data: float, comm: float) -> dict[str, float]:
    """Forward, backward and optimizer share what data, comm and other leave of the step."""
    rest = max(STEP_S - data - comm - OTHER_S, 0.0)
    return {"forward_s": 0.4 * rest, "backward_s": 0.5 * rest, "optimizer_s": 0.1 * rest}


def _dump(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build_run(
    root: Path,
    *,
    world: int = 8,
    engine: str = "ddp",
    precision: str = "bf16",
    intervals: int = 6,
    log_every: int = 10,
    tokens_per_step: int = 1000,
    loss: Any = lambda tokens: 2.0 + 8.0 * math.exp(-tokens / 20_000),
    comm: float = 0.05,  # share of the step
    data: float = 0.02,
    mem: float = 0.6,  # peak / capacity
    straggler: tuple[int, float, int] | None = None,  # (rank, excess, in how many intervals)
    disagree_at: int | None = None,
    hang: bool = False,
    nonfinite_at: int | None = None,
    checkpoint_blocking_s: float = 0.5,
    activation_checkpointing: bool = False,
    ranks: bool = True,
    hosts: list[str] | None = None,
    pipeline: dict[str, Any] | None = None,  # run.json's "pipeline" (the engine's layout)
    eval_every: int = 0,  # steps between eval rows (training/evaluation.py), their loss 0.3 above training's
) -> Path:
    root.mkdir(parents=True)
    hosts = hosts or [f"node{r // 4}" for r in range(world)]
    info = {
        "engine": engine,
        "world_size": world,
        "parallel": {"pp": 1, "dp_replicate": 1, "dp_shard": world, "cp": 1, "tp": 1, "dp_size": world},
        "backend": "nccl",
        "device": "cuda",
        "device_name": "NVIDIA H100 80GB HBM3",
        "precision": precision,
        "hosts": hosts,
        "peak_flops": 989e12,
        "device_memory_bytes": CAPACITY,
    }
    if pipeline:
        pp = len(pipeline["stages"])
        info |= {
            "pipeline": pipeline,
            "parallel": {**info["parallel"], "pp": pp, "dp_shard": world // pp, "dp_size": world // pp},
        }
    (root / "run.json").write_text(json.dumps(info))
    overrides = [
        f"parallel.strategy={engine}",
        f"precision={precision}",
        "model.preset=tiny",
        "data.seq_len=64",
        "train.micro_batch=4",
        "train.grad_accum=2",
        f"train.log_every={log_every}",
        f"parallel.activation_checkpointing={str(activation_checkpointing).lower()}",
    ]
    (root / "config.yaml").write_text(load_config(overrides=overrides).to_yaml())
    rows: list[dict[str, Any]] = []
    rank_rows: list[dict[str, Any]] = []
    for step in range(1, intervals * log_every + 1):
        bad = nonfinite_at is not None and step >= nonfinite_at
        tokens = step * tokens_per_step
        rows.append({"step": step, "loss": loss(tokens), "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0,
                     "step_time_s": 1.0, "tokens": tokens, "nonfinite_steps": int(bad), "rollbacks": 0})  # fmt: skip
        if eval_every and step % eval_every == 0:
            rows.append({"step": step, "event": "eval", "loss": loss(tokens) + 0.3, "perplexity": math.exp(loss(tokens) + 0.3),
                         "tokens": 4096, "samples": 64, "data": "eval.split=0.01 (30 of 3000 documents)", "eval_s": 0.5})  # fmt: skip
        if step % log_every:
            continue
        i = step // log_every - 1
        phases = {"data_s": data, **compute_phases(data, comm), "comm_s": comm, "other_s": OTHER_S}
        rows.append({"step": step, "event": "interval", "steps": log_every, "wall_s": float(log_every), "step_s": 1.0,
                     "tokens_per_s": 1000.0 + 10 * i, "samples_per_s": 15.6, "effective_batch": 64, "mfu": 0.41,
                     "mem_peak_bytes": int(mem * CAPACITY), "mem_capacity_bytes": CAPACITY, "gpu_util": 97.0,
                     "gpu_hours": world * step / 3600, "cost": None, "phases": phases})  # fmt: skip
        if straggler and i >= intervals - straggler[2]:
            rank, excess, _ = straggler
            rows.append({"step": step, "event": "straggler", "rank": rank, "host": hosts[rank],
                         "step_s": 0.9 * (1 + excess), "median_s": 0.9, "excess": excess})  # fmt: skip
        if disagree_at is not None and step >= disagree_at:
            groups = [[r for r in range(world) if r != 3], [3]]
            rows.append(
                {"step": step, "event": "replicas_disagree", "what": "weights", "ranks": list(range(world)), "groups": groups}
            )
        if step % (2 * log_every) == 0:
            rows.append({"step": step, "event": "checkpoint", "async": True, "blocking_s": checkpoint_blocking_s,
                         "waited_for_previous_s": 0.0, "total_s": 4.0})  # fmt: skip
        for r in range(world):
            slow = 1 + (straggler[1] if straggler and r == straggler[0] else 0)
            rank_rows.append({"step": step, "rank": r, "host": hosts[r], "steps": log_every, "step_s": 1.0, "data_s": data,
                              **{k: v * slow for k, v in compute_phases(data, comm).items()}, "comm_s": comm,
                              "mem_peak_bytes": int((mem - 0.01 * (r % 3)) * CAPACITY), "mem_reserved_bytes": None,
                              "gpu_util": 97.0})  # fmt: skip
    _dump(root / "metrics.jsonl", rows)
    if ranks:
        _dump(root / "ranks.jsonl", rank_rows)
    if hang:
        (root / "hang").mkdir()
        last = [intervals * log_every] * world
        last[5] -= 1
        summary = {"step": last, "stuck_ranks": [5], "timeout_s": 300.0,
                   "collective": {"seq": 812, "name": "nccl:all_reduce", "process_group": "default",
                                  "waiting_ranks": [r for r in range(world) if r != 5], "missing_ranks": [5]}}  # fmt: skip
        (root / "hang" / "hang.json").write_text(json.dumps(summary))
        for r in range(world):
            (root / "hang" / f"rank{r}.txt").write_text("Thread 0x1 (most recent call first):\n")
    return root


@pytest.fixture
def make_run(tmp_path):
    """make_run(name="run", **knobs): a synthetic run directory (build_run's knobs)."""
    return lambda name="run", **knobs: build_run(tmp_path / name, **knobs)


def warnings_of(findings) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in findings:
        if f.severity == "warning":
            out.setdefault(f.code, []).append(f)
    return out


def figure(page: str, plot_id: str) -> str:
    """The markup of one plot's <figure>, from its id to its end."""
    start = page.index(f'id="{plot_id}"')
    return page[start : page.index("</figure>", start)]


@pytest.mark.unit
def test_healthy_run_has_no_warnings(make_run):
    findings = diagnose(make_run())
    assert [f.code for f in findings] == ["clock", "summary"], [(f.code, f.title) for f in findings]

    summary = findings[-1]
    text = " | ".join([summary.title, *summary.evidence])
    for fragment in (
        "ddp",
        "world 8",
        "bf16",
        "60 steps",
        "60,000 tokens",
        "1,025 tokens/s",
        "MFU 41.0%",
        "48.0 GiB",
        "final loss",
    ):
        assert fragment in text, (fragment, text)


@pytest.mark.unit
def test_the_plans_clock_beside_the_measured_phases_names_the_term_that_missed(make_run):
    from scaletrain.diagnose.clock import predicted_step

    run = load_run(make_run())
    t = predicted_step(run)
    assert t is not None and "H100" in t.source  # the run's GPU, from run.json's device name
    (f,) = [f for f in diagnose(run.root) if f.code == "clock"]
    assert f.severity == "info" and f.title.startswith(f"predicted step {t.total:.4g} s against 1 s measured")
    passes = sum(t.phases[k] for k in ("forward", "backward", "comm", "bubble", "offload"))
    (line,) = [e for e in f.evidence if e.startswith("forward and backward: ")]
    assert line.startswith(f"forward and backward: predicted {passes:.4g} s, measured ")
    # The synthetic run's measured step is 1 s, the tiny model's predicted step milliseconds:
    # the passes miss most.
    (missed,) = [e for e in f.evidence if e.startswith("the term that missed most: ")]
    assert missed.startswith("the term that missed most: forward and backward (-") and "block: " in missed


# Each problem alone: its rule fires, and only its rule (they do not overlap).
RULE_CASES = {
    "comm_bound": ({"comm": 0.41}, "communication is 41% of step time", "train.grad_accum"),
    "straggler": (
        {"straggler": (5, 0.23, 4)},
        "rank 5 (host node1) is 23% slower than the median in 4 of 5 intervals",  # the warm-up one is not judged
        "throttling",
    ),
    "memory_high": ({"mem": 0.95}, "memory peak 95% of the device", "activation checkpointing saves about"),
    "replicas_disagree": ({"disagree_at": 40}, "replicas disagree since step 40", "checkpoint of step 20"),
    "data_bound": ({"data": 0.3}, "data loading is 30% of the step", "data.dir"),
    "hang": ({"hang": True}, "the run hung: rank 5 stopped", "hang/rank5.txt"),
    "nonfinite": ({"nonfinite_at": 33}, "1 non-finite step, 0 rollbacks", "train.lr"),
    # 1f1b on 4 stages with 4 micro-batches: 3 / 7 of each step idle.
    "pipeline_bubble": (
        {"pipeline": {"schedule": "1f1b", "stages": [[0, 1], [2, 3], [4, 5], [6, 7]], "micro_batches": 4, "bubble": 3 / 7}},
        "pipeline ranks idle 43% of each step",
        "at least 16 micro-batches for pp 4",
    ),
    "checkpoint_blocking": (
        {"checkpoint_blocking_s": 4.0},
        "checkpoints block 13% of the run",
        "checkpoint.every (now 100)",
    ),  # the last save (step 60) blocks nothing
}


@pytest.mark.unit
@pytest.mark.parametrize("code", list(RULE_CASES))
def test_rule_fires_on_its_problem(make_run, code):
    knobs, title, advice = RULE_CASES[code]
    found = warnings_of(diagnose(make_run(**knobs)))
    assert list(found) == [code], {c: [f.title for f in fs] for c, fs in found.items()}
    assert found[code][0].title == title
    assert advice in found[code][0].advice, found[code][0].advice


@pytest.mark.unit
def test_comm_bound_skips_warmup_and_names_engine(make_run):
    (f,) = warnings_of(diagnose(make_run(engine="fsdp", comm=0.3)))["comm_bound"]
    assert "median over 5 intervals (steps 20-60" in f.evidence[0] and "0.3 s of exposed communication" in f.evidence[0]
    assert "parallel.reshard_after_forward=false" in f.advice and "micro-batch 4 x grad_accum 2" in f.evidence[1]
    assert not warnings_of(diagnose(make_run("at-threshold", comm=0.25)))  # the threshold itself is no alarm


@pytest.mark.unit
def test_straggler_evidence_and_host(make_run):
    (f,) = warnings_of(diagnose(make_run(straggler=(6, 0.5, 3))))["straggler"]
    assert f.title == "rank 6 (host node1) is 50% slower than the median in 3 of 5 intervals"
    assert "at steps 40, 50, 60" in f.evidence[0] and "node1" in f.advice
    # Flagged in only 2 of 5 judged intervals: noise, not a straggler.
    assert "straggler" not in warnings_of(diagnose(make_run("noise", straggler=(6, 0.5, 2))))


@pytest.mark.unit
def test_memory_high_with_and_without_activation_checkpointing(make_run):
    (f,) = warnings_of(diagnose(make_run(mem=0.97)))["memory_high"]
    share = int(re.search(r"saves about (\d+)% of the peak \(planner\)", f.advice).group(1))
    assert 5 <= share < 100, f.advice
    assert "77.6 GiB of 80.0 GiB" in f.evidence[0] and "rank 0 (host node0)" in f.evidence[1]
    (f,) = warnings_of(diagnose(make_run("ac", mem=0.97, activation_checkpointing=True)))["memory_high"]
    assert "planner" not in f.advice and "parallel.strategy=fsdp or zero3" in f.advice and "train.grad_accum" in f.advice


@pytest.mark.unit
def test_hang_names_ranks_hosts_collective_and_steps(make_run):
    (f,) = warnings_of(diagnose(make_run(hang=True)))["hang"]
    text = "\n".join(f.evidence)
    assert "rank 5 (host node1): last step 59" in text
    assert "collective nccl:all_reduce #812" in text and "missing ranks [5]" in text
    assert "last step per rank: 0:60, 1:60" in text


@pytest.mark.unit
def test_profile_split_per_rank_and_top_ops(make_run, monkeypatch):
    run = make_run()
    (run / "profile").mkdir()
    for r in (0, 1):
        (run / "profile" / f"rank{r}.trace.json").write_text("{}")

    def analyze_trace(path):  # stand-in for scaletrain.telemetry.profile.analyze_trace
        rank = int(Path(path).name[4])
        ops = [{"name": f"op{i}", "self_s": 0.1 * (8 - i) + rank, "count": 10} for i in range(7)]
        cuda = {"kernel_s": {"matmul": 1.0, "attention": 0.3}, "gpu_idle_s": 0.2} if rank == 1 else {}  # rank 1's on CUDA
        return {"total_s": 2.0, "comm_s": 0.5 + rank * 0.5, "compute_s": 1.5 - rank * 0.5, "top_ops": ops, **cuda}

    module = types.ModuleType("scaletrain.telemetry.profile")
    module.analyze_trace = analyze_trace  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "scaletrain.telemetry.profile", module)
    findings = diagnose(run)
    assert not warnings_of(findings)
    (f,) = [f for f in findings if f.code == "profile"]
    assert f.severity == "info" and f.title == "profile of 2 ranks: communication 38% of traced time (median rank)"
    assert "rank0: 2 s traced, communication 25%, computation 75%" in f.evidence
    assert "rank1: 2 s traced, communication 50%, computation 50%" in f.evidence
    assert "rank1 on the device: matmul 50%, attention 15%, idle device 10%" in f.evidence
    assert not any(line.startswith("rank0 on the device") for line in f.evidence)  # a CPU trace has no device
    tops = [line for line in f.evidence if line.startswith("top operator")]
    assert [t.split()[2].rstrip(":") for t in tops] == ["op0", "op1", "op2", "op3", "op4"]
    assert "2.6 s self time in 20 calls" in tops[0]


@pytest.mark.unit
def test_report_is_self_contained_and_escaped(make_run):
    run = make_run(comm=0.4, hosts=[f"<b>h{r}</b>" for r in range(8)], straggler=(2, 0.3, 3), hang=True)
    findings = diagnose(run)
    page = write_report(run, findings).read_text()
    for plot_id in PLOT_IDS:
        assert "<svg" in figure(page, plot_id), plot_id
    assert {c for c in re.findall(r'class="finding[^"]*" data-code="([^"]+)"', page)} == {
        "hang",
        "comm_bound",
        "straggler",
        "clock",
        "summary",
    }
    # Host names (in titles and evidence) are text, not markup.
    assert "&lt;b&gt;h2&lt;/b&gt;" in page and "&lt;b&gt;h5&lt;/b&gt;" in page and "<b>h" not in page
    assert not re.search(r"<script|<link|<img|<iframe|@import|url\((?!#)|(src|href)=\"(?!#)", page)
    assert "default-src 'none'" in page
    # Missing data: a note, not a failure.
    bare = make_run("bare", ranks=False)
    page = write_report(bare, diagnose(bare)).read_text()
    assert "no data: no ranks.jsonl" in figure(page, "plot-breakdown") and "<svg" not in figure(page, "plot-breakdown")
    assert "<svg" in figure(page, "plot-memory")  # from the interval events instead


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_report_renders_in_chromium(make_run, tmp_path):
    run = make_run(comm=0.35, straggler=(5, 0.23, 4), hang=True, mem=0.95)
    findings = diagnose(run)
    dom = render_in_chromium(write_report(run, findings), tmp_path)
    for plot_id in PLOT_IDS:
        assert "<svg" in figure(dom, plot_id), f"{plot_id} has no <svg> in the rendered DOM"
    rendered = set(re.findall(r'data-code="([^"]+)"', dom))
    assert rendered == {f.code for f in findings} >= {"comm_bound", "straggler", "hang", "memory_high", "summary"}


@pytest.mark.unit
def test_compare_loss_at_equal_tokens(make_run):
    # a: 1000 tokens/step for 60 steps; b: 1500 tokens/step for 40 steps (60,000 tokens, the
    # most both reach). At 60,000 tokens a has its own row (step 60), b too (step 40).
    # c: 700 tokens/step for 90 steps: 63,000 tokens; at 60,000 it needs interpolation.
    a = make_run("a", tokens_per_step=1000)
    b = make_run("b", tokens_per_step=1500, intervals=4, engine="fsdp", world=4)
    c = make_run("c", tokens_per_step=700, intervals=9, loss=lambda t: 10.0 - t / 10_000)
    rows = compare([a, b])
    assert [r["equal_tokens"] for r in rows] == [60_000, 60_000]
    want = 2.0 + 8.0 * math.exp(-3)
    assert rows[0]["loss_at_equal_tokens"] == pytest.approx(want) and rows[0]["loss_method"] == "step 60 (exactly)"
    assert rows[1]["loss_at_equal_tokens"] == pytest.approx(want) and rows[1]["loss_method"] == "step 40 (exactly)"
    assert (rows[1]["engine"], rows[1]["world"], rows[1]["micro_batch"], rows[1]["grad_accum"]) == ("fsdp", 4, 4, 2)
    assert rows[0]["gpu_hours_per_billion_tokens"] == pytest.approx(8 * 60 / 3600 / 60e-6)
    assert rows[0]["tokens_per_s"] == 1025.0 and rows[0]["peak_memory_bytes"] == int(0.6 * CAPACITY)
    rows = compare([c, a])
    assert rows[0]["equal_tokens"] == 60_000
    # 60,000 / 700 = 85.71: between steps 85 (59,500 tokens) and 86 (60,200), linear in tokens.
    assert (
        rows[0]["loss_at_equal_tokens"] == pytest.approx(4.0) and rows[0]["loss_method"] == "interpolated between steps 85 and 86"
    )


@pytest.mark.unit
def test_cli_diagnose_and_compare(make_run, capsys):
    run = make_run(data=0.3)
    assert main(["diagnose", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [f["code"] for f in out] == ["data_bound", "clock", "summary"]
    assert set(out[0]) == {"severity", "code", "title", "evidence", "advice"} and out[0]["severity"] == "warning"
    assert (run / "report.html").is_file()
    (run / "report.html").unlink()
    assert main(["diagnose", str(run), "--no-html"]) == 0
    text = capsys.readouterr().out
    assert "warning data loading is 30% of the step (data_bound)" in text and "1 warning" in text
    assert not (run / "report.html").exists() and "report:" not in text
    other = make_run("other", engine="zero2")
    assert main(["compare", str(run), str(other)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"engine\W+ddp\W+zero2", text) and "loss at equal tokens" in text and "step 60 (exactly)" in text
    assert main(["compare", str(run), str(other), "--json"]) == 0
    assert [r["engine"] for r in json.loads(capsys.readouterr().out)] == ["ddp", "zero2"]
    import scaletrain.diagnose

    assert callable(scaletrain.diagnose.compare)  # the function, not the submodule the CLI imported


@pytest.mark.unit
def test_cli_rejects_a_directory_that_is_no_run(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")  # metrics without run.json: not a run directory
    one_line_error(scaletrain(["diagnose", str(tmp_path)]), "is not a run directory: no run.json", "accepted:")
    assert main(["diagnose", str(tmp_path / "absent")]) == 2
    assert main(["compare", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "absent is not a directory" in err[0] and "two or more run directories" in err[1], err


@pytest.mark.unit
def test_breakdown_weights_intervals_by_steps(make_run):
    from scaletrain.diagnose import load_run
    from scaletrain.diagnose.report import breakdown

    run = load_run(make_run(world=2, intervals=1))
    row = {"rank": 0, "host": "a", "data_s": 0.0, "forward_s": 0.2, "backward_s": 0.4, "optimizer_s": 0.1, "comm_s": None}
    run.ranks = [{**row, "step": 10, "steps": 10, "step_s": 9.0}]  # warm-up: left out
    run.ranks += [
        {**row, "step": 20, "steps": 10, "step_s": 1.0},
        {**row, "step": 22, "steps": 2, "step_s": 1.6, "forward_s": 0.8},
    ]
    got = breakdown(run)[0]
    assert got["forward_s"] == pytest.approx((10 * 0.2 + 2 * 0.8) / 12) and got["comm_s"] == 0.0
    assert got["other_s"] == pytest.approx((10 * 0.3 + 2 * 0.3) / 12)


@pytest.mark.unit
def test_the_loss_plot_shows_the_eval_curve_beside_training(make_run):
    from matplotlib.figure import Figure

    from scaletrain.diagnose import load_run
    from scaletrain.diagnose.report import _loss

    path = make_run(eval_every=15, intervals=3)
    ax = Figure().add_subplot()
    assert _loss(ax, load_run(path)) is None
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"training (each step's batch)", "eval (the fixed held-out windows)"}
    evaluated = lines["eval (the fixed held-out windows)"]
    steps = [15, 30]
    assert list(evaluated.get_xdata()) == steps and list(lines["training (each step's batch)"].get_xdata()) == list(range(1, 31))
    want = [2.0 + 8.0 * math.exp(-s * 1000 / 20_000) + 0.3 for s in steps]
    assert list(evaluated.get_ydata()) == pytest.approx(want)
    # In the page: the legend's text (glyphs drawn as paths; matplotlib keeps the text in a comment).
    page = write_report(path, diagnose(path)).read_text()
    assert "eval (the fixed held-out windows)" in figure(page, "plot-loss")
    bare = make_run("bare")  # no evaluation: the training curve alone, no legend
    assert "eval (" not in figure(write_report(bare, diagnose(bare)).read_text(), "plot-loss")


@pytest.mark.unit
def test_task_accuracy_is_drawn_against_tokens_trained(make_run):
    from matplotlib.figure import Figure

    from scaletrain.diagnose import load_run
    from scaletrain.diagnose.report import _tasks

    path = make_run(eval_every=15, intervals=3)  # 1,000 tokens a step
    tasks = [
        {"step": s, "event": "task", "task": name, "kind": "multiple_choice", "acc": acc, "acc_norm": acc + 0.1, "items": 40,
         "shots": 0, "eval_s": 0.1}
        for s, acc in ((15, 0.3), (30, 0.5)) for name in ("arc", "piqa")
    ]  # fmt: skip
    with open(path / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in tasks))
    ax = Figure().add_subplot()
    assert _tasks(ax, load_run(path)) is None
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"arc acc", "arc acc_norm", "piqa acc", "piqa acc_norm"}
    assert list(lines["arc acc"].get_xdata()) == [15_000, 30_000] and list(lines["arc acc"].get_ydata()) == [0.3, 0.5]
    assert list(lines["piqa acc_norm"].get_ydata()) == pytest.approx([0.4, 0.6])
    assert "piqa acc_norm" in figure(write_report(path, diagnose(path)).read_text(), "plot-tasks")
    bare = make_run("bare")
    assert 'id="plot-tasks"' not in write_report(bare, diagnose(bare)).read_text()
