"""A mixture of experts' routing, watched (issue 27, item 6): per MoE layer and log interval,
the token slots each expert took summed over ranks and steps, the max/mean imbalance, the
auxiliary loss per forward and the dropped slots, in metrics.jsonl and TensorBoard; diagnose
names a collapsing router (router_collapse) and draws the load as a heat map.

Real runs: tiny-moe (4 MoE layers, 8 experts, top-2) at world 1 (micro-batch 4 x 2
accumulated) and at world 2 under fsdp with expert parallelism and activation checkpointing
(micro-batch 4 per rank): the same micro-batches (data/loader.py), so the same routing. A
third run forces one layer's router onto two experts. The rule's line is checked on rows
written by hand."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.diagnose import diagnose, write_report
from scaletrain.models.moe import EXTRA_STATS, STAT_AUX, STAT_BALANCE, STAT_DROPPED, STAT_TOKENS, STAT_Z
from scaletrain.telemetry import read_metrics
from scaletrain.telemetry.experts import expert_load

from helpers.launch import check, run, train
from helpers.runs import base_overrides
from sink_readers import tensorboard_scalars

LAYERS, EXPERTS, TOP_K = 4, 8, 2  # tiny-moe
MICRO, ACCUM, SEQ, LOG_EVERY = 4, 2, 64, 5
TOKENS_PER_STEP = MICRO * ACCUM * SEQ  # 512: one process x 2 micro-batches, or 2 ranks x 1
MOE = ["model.preset=tiny-moe", f"train.micro_batch={MICRO}", "checkpoint.every=0"]


def intervals(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl", events=True) if r.get("event") == "interval"]


def figure(page: str, plot_id: str) -> str:
    start = page.index(f'id="{plot_id}"')
    return page[start : page.index("</figure>", start)]


def heat_cells(page: str) -> list[str]:
    """The fill of each heat-map cell, row by row (layer, expert) then column (interval)."""
    mesh = figure(page, "plot-experts")
    start = mesh.index('<g id="QuadMesh_1">')
    return re.findall(r'style="fill: (#[0-9a-f]{6})"', mesh[start : mesh.index("</g>", start)])


@pytest.fixture(scope="module")
def one_process(small_dataset, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe-watch") / "w1"
    check(train([*base_overrides(small_dataset, run_dir), *MOE, f"train.grad_accum={ACCUM}", "telemetry.tensorboard=true"]))
    return run_dir


@pytest.fixture(scope="module")
def expert_parallel(small_dataset, tmp_path_factory):
    # Activation checkpointing runs each block's forward again in backward: still counted once.
    run_dir = tmp_path_factory.mktemp("moe-watch") / "ep2"
    ep = ["parallel.strategy=fsdp", "parallel.ep=2", "parallel.activation_checkpointing=true"]
    check(train([*base_overrides(small_dataset, run_dir), *MOE, *ep], nproc=2))
    return run_dir


# ---------------------------------------------------------------------------- real runs


@pytest.mark.e2e
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["one_process", "expert_parallel"])
def test_expert_load_counts_every_routed_slot_once(layout, request):
    rows = intervals(request.getfixturevalue(layout))
    assert [r["step"] for r in rows] == [5, 10]
    for row in rows:
        moe, steps = row["moe"], row["steps"]
        assert moe["tokens"] == TOKENS_PER_STEP * steps  # every rank's tokens, every step
        assert len(moe["layers"]) == LAYERS
        for layer in moe["layers"]:
            load = layer["load"]
            assert len(load) == EXPERTS and all(isinstance(x, int) and x >= 0 for x in load)
            # Exact: each token fills top_k slots of each layer, on whichever rank it was routed.
            assert sum(load) == TOKENS_PER_STEP * TOP_K * steps
            assert layer["imbalance"] == round(max(load) / (sum(load) / EXPERTS), 4) >= 1.0
            assert layer["dropped"] == 0  # dropless
            # The weighted auxiliary loss per forward: 0.02 x balance (>= ~1) + 0.001 x z (~ln(8)^2).
            assert 0.02 < layer["aux"] < 0.05


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_expert_parallel_counts_what_one_process_counts(one_process, expert_parallel):
    # Same micro-batches, same weights up to summation order: the same routing, so the same
    # loads (measured equal; a few slots allowed for a near tie decided the other way) and
    # the same auxiliary loss per forward (2 micro-batches on one rank = 1 on each of two).
    for a, b in zip(intervals(one_process), intervals(expert_parallel), strict=True):
        for la, lb in zip(a["moe"]["layers"], b["moe"]["layers"], strict=True):
            assert max(abs(x - y) for x, y in zip(la["load"], lb["load"])) <= 0.01 * sum(la["load"])
            assert lb["aux"] == pytest.approx(la["aux"], rel=1e-3)


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_tensorboard_gets_a_few_scalars_per_layer(one_process):
    tb = tensorboard_scalars(one_process / "tensorboard")
    rows = intervals(one_process)
    for i in range(LAYERS):
        for key in ("imbalance", "aux", "balance", "z", "dropped"):
            want = {r["step"]: float(r["moe"]["layers"][i][key]) for r in rows}
            assert tb[f"moe/layer{i}/{key}"] == pytest.approx(want, rel=1e-6)  # float32 in the event file
    assert tb["moe/aux"] == pytest.approx({r["step"]: r["moe"]["aux"] for r in rows}, rel=1e-6)
    assert {t for t in tb if t.startswith("moe/")} == {"moe/aux"} | {
        f"moe/layer{i}/{k}" for i in range(LAYERS) for k in ("imbalance", "aux", "balance", "z", "dropped")
    }


# One layer's router pushed onto experts 5 and 6 (a constant added to their logits, far above
# what 8 steps of training move): every token of MoE layer 2 goes to them.
FORCED = """
import sys
import torch
from scaletrain.cli import main
from scaletrain.models import llama

init = llama.Llama.__init__
BIAS = [10.0 if e in (5, 6) else 0.0 for e in range(8)]

def forced(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.layers[2].feed_forward.router.register_forward_hook(
        lambda module, inputs, out: out + torch.tensor(BIAS, device=out.device, dtype=out.dtype))

llama.Llama.__init__ = forced
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_collapsed_router_is_named_and_healthy_ones_are_not(one_process, expert_parallel, small_dataset, tmp_path):
    forced = tmp_path / "forced"
    # The balance counted per micro-batch, as this run was first measured: by step 8 its other
    # layers stay under the top of the scale (3.95 at most), where per sequence two of them
    # reach it too (4.0, their routing as lopsided as the forced layer's after 8 steps at this
    # learning rate). What is checked here is the report, not which balance keeps them healthier.
    overrides = [
        *base_overrides(small_dataset, forced, steps=8), *MOE, "train.micro_batch=2", "train.log_every=2", "model.moe.balance=aux"
    ]  # fmt: skip
    check(run([sys.executable, "-c", FORCED, "train", *overrides]))
    [finding] = [f for f in diagnose(forced) if f.code == "router_collapse"]
    assert finding.severity == "warning" and "1 of 4 MoE layers" in finding.title and "100%" in finding.title
    [layer] = [line for line in finding.evidence if line.startswith("MoE layer")]
    assert layer.startswith("MoE layer 2 (block 2): experts 5, 6 took 100% of its token slots")
    assert "starved (under a tenth of their share): experts 0, 1, 2, 3, 4, 7" in layer
    assert "last 3 log intervals (steps 3-8)" in finding.evidence[-1]
    for knob in ("model.moe.aux_loss_weight (now 0.02", "model.moe.capacity_factor=1.25", "model.moe.z_loss_weight (now 0.001"):
        assert knob in finding.advice
    for healthy in (one_process, expert_parallel):
        assert "router_collapse" not in {f.code for f in diagnose(healthy)}

    # The heat map: a cell per (layer, expert) and interval; layer 2's experts 5 and 6 at
    # four times their fair share (every token, the top of the scale), its others idle.
    page = write_report(forced, diagnose(forced)).read_text()
    assert "<svg" in figure(page, "plot-experts") and "no data" not in figure(page, "plot-experts")
    cells = heat_cells(page)
    columns = 4  # 8 steps, an interval every 2
    assert len(cells) == LAYERS * EXPERTS * columns
    row = lambda layer, expert: cells[(layer * EXPERTS + expert) * columns :][:columns]  # noqa: E731
    darkest_red, darkest_blue = "#67001f", "#053061"  # RdBu_r at 4 and at 0
    assert row(2, 5) == row(2, 6) == [darkest_red] * columns
    assert all(row(2, e) == [darkest_blue] * columns for e in (0, 1, 2, 3, 4, 7))
    assert darkest_red not in {c for layer in (0, 1, 3) for e in range(EXPERTS) for c in row(layer, e)}
    healthy = write_report(one_process, diagnose(one_process)).read_text()
    assert len(heat_cells(healthy)) == LAYERS * EXPERTS * 2


# ---------------------------------------------------------------------------- by hand


@pytest.mark.unit
def test_expert_load_sums_the_ranks_and_means_the_aux_loss_per_forward():
    def stats(load: list[list[int]], dropped: int, aux: float, tokens: int, balance: float, z: float) -> torch.Tensor:
        extra = [0.0] * EXTRA_STATS
        extra[STAT_DROPPED], extra[STAT_AUX], extra[STAT_TOKENS] = dropped, aux, tokens
        extra[STAT_BALANCE], extra[STAT_Z] = balance, z
        return torch.tensor([[*row, *extra] for row in load], dtype=torch.float32)

    rank0 = stats([[6, 2, 0, 0], [2, 2, 2, 2]], dropped=1, aux=0.5, tokens=4, balance=3.0, z=1.5)
    rank1 = stats([[0, 0, 4, 4], [4, 0, 4, 0]], dropped=2, aux=0.25, tokens=4, balance=6.0, z=0.0)
    moe = expert_load([rank0, rank1], forwards=3)
    assert moe is not None and moe["tokens"] == 8
    first, second = moe["layers"]
    # Per forward of each rank (3 x 2): the weighted term, and the two terms unweighted.
    want = {"aux": pytest.approx(0.75 / 6), "balance": pytest.approx(9 / 6), "z": pytest.approx(1.5 / 6)}
    assert first == {"load": [6, 2, 4, 4], "imbalance": 1.5, **want, "dropped": 3}
    assert second["load"] == [6, 2, 6, 2] and second["imbalance"] == 1.5
    assert moe["aux"] == pytest.approx(2 * 0.75 / 6)  # the layers' terms summed: what the objective added
    assert expert_load([None, None], forwards=3) is None  # a dense model


def busiest_at(share: float, experts: int = EXPERTS, group: int = 2, total: int = 10_000) -> list[int]:
    """A layer's load whose busiest `group` experts hold `share` of the slots (evenly)."""
    top = [round(share * total / group)] * group
    rest = total - sum(top)
    return top + [rest // (experts - group) + (e < rest % (experts - group)) for e in range(experts - group)]


def hand_run(root: Path, shares: list[float], *, experts: int = EXPERTS, k: int = TOP_K, group: int = 2) -> Path:
    """A run directory whose MoE layer 1 (of 2) has its busiest `group` experts at shares[j]
    in interval j (each of 10 steps); layer 0 stays balanced."""
    root.mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"engine": "fsdp", "world_size": 2, "device": "cpu", "precision": "fp32"}))
    (root / "config.yaml").write_text(load_config(overrides=["model.preset=tiny-moe"]).to_yaml())
    rows = []
    for j, share in enumerate(shares):
        step, total = 10 * (j + 1), 10_000
        layers = [busiest_at(1 / experts * group, experts, group, total), busiest_at(share, experts, group, total)]
        moe = {
            "tokens": total // k,
            "layers": [{"load": x, "imbalance": max(x) * experts / total, "aux": 0.03, "dropped": 0} for x in layers],
        }
        rows.append({"step": step, "loss": 3.0, "tokens": step * 512})
        rows.append(
            {"step": step, "event": "interval", "steps": 10, "wall_s": 1.0, "step_s": 0.1, "tokens_per_s": 5120.0, "moe": moe}
        )
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def collapse(root: Path) -> list[Any]:
    return [f for f in diagnose(root) if f.code == "router_collapse"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("shares", "named"),
    [
        ([0.3, 0.75, 0.76, 0.8], True),  # the line, 8 experts top-2: 25% + 2/3 x 75% = 75%
        ([0.3, 0.74, 0.9, 0.9, 0.9], True),  # only the last three count
        ([0.3, 0.9, 0.74, 0.9], False),  # below it once among them: a swing, not a collapse
        ([0.9, 0.3, 0.3, 0.3], False),  # in the first interval only (warm-up), then healthy
        ([0.3, 0.74, 0.74, 0.74], False),
        ([0.3, 0.9], True),  # two intervals: the second alone is judged
    ],
)
def test_the_collapse_line(tmp_path, shares, named):
    found = collapse(hand_run(tmp_path / "run", shares))
    assert bool(found) == named
    if named:
        [f] = found
        assert f.title.startswith("router collapse in 1 of 2 MoE layers: 2 of 8 experts take")
        assert f.evidence[0].startswith("MoE layer 1 (block 1): experts 0, 1 took")


@pytest.mark.unit
def test_the_busiest_group_is_a_quarter_of_the_experts_and_at_least_top_k(tmp_path):
    # 64 experts top-6 (DeepSeekMoE): a quarter is 16 experts, fair share 25%, the line 75%.
    assert collapse(hand_run(tmp_path / "a", [0.3, 0.76], experts=64, k=6, group=16))
    assert not collapse(hand_run(tmp_path / "b", [0.3, 0.74], experts=64, k=6, group=16))
    # 8 experts top-4: the group is 4 (a quarter, 2, could take only half the slots): fair
    # share 50%, the line 83.3%; 80% of the slots on 4 experts is not yet a collapse.
    assert collapse(hand_run(tmp_path / "c", [0.5, 0.84], k=4, group=4))
    assert not collapse(hand_run(tmp_path / "d", [0.5, 0.82], k=4, group=4))


@pytest.mark.unit
def test_a_dense_run_has_no_heat_map_and_no_verdict(tmp_path):
    root = hand_run(tmp_path / "run", [0.3, 0.9])
    rows = [r for r in read_metrics(root / "metrics.jsonl", events=True)]
    for r in rows:
        r.pop("moe", None)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert not collapse(root)
    assert 'id="plot-experts"' not in write_report(root, diagnose(root)).read_text()


@pytest.mark.unit
def test_many_intervals_merge_into_at_most_the_cell_budget(tmp_path):
    from scaletrain.diagnose.report import MAX_CELLS

    root = hand_run(tmp_path / "run", [0.3] * 300)  # 2 layers x 8 experts x 300 intervals
    cells = heat_cells(write_report(root, diagnose(root)).read_text())
    per = math.ceil(300 * 2 * EXPERTS / MAX_CELLS)
    assert len(cells) == 2 * EXPERTS * math.ceil(300 / per) <= MAX_CELLS


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_the_loss_plot_shows_the_routers_terms_apart_from_the_cross_entropy(one_process):
    from matplotlib.figure import Figure

    from scaletrain.diagnose import load_run
    from scaletrain.diagnose.report import ROUTERS, _loss

    ax = Figure().add_subplot()
    assert _loss(ax, load_run(one_process)) is None
    (right,) = [a for a in ax.figure.axes if a is not ax]  # their own axis: ~0.03 beside a loss of ~6
    (routers,) = right.get_lines()
    rows = intervals(one_process)
    assert routers.get_label() == ROUTERS and list(routers.get_xdata()) == [r["step"] for r in rows]
    assert list(routers.get_ydata()) == [r["moe"]["aux"] for r in rows]
    assert "training (each step's batch)" in [line.get_label() for line in ax.get_lines()]
    page = write_report(one_process, diagnose(one_process)).read_text()
    assert ROUTERS in figure(page, "plot-loss")
