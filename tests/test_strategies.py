"""The strategy table is the one place engine knowledge lives: every row names an engine
module and a format that exist, and the config, the layout and the guards answer as the
rows say (so a capability changed in the table changes what is accepted, nowhere else)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from scaletrain.config import load_config
from scaletrain.config.parallel import parallel_dims
from scaletrain.errors import UserError
from scaletrain.strategies import FORMATS, STRATEGIES, TABLE, strategy

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[1] / "src" / "scaletrain"


def accepted(*overrides: str) -> bool:
    try:
        load_config([], list(overrides))
    except UserError:
        return False
    return True


def test_every_row_has_its_engine_module_and_format():
    for row in TABLE.values():
        assert importlib.util.find_spec(f"scaletrain.engines.{row.engine}") is not None, row.name
        assert "\nENGINE = " in (SRC / "engines" / f"{row.engine}.py").read_text(), row.name
        assert row.format in FORMATS, row.name
    with pytest.raises(UserError, match="unknown parallel.strategy 'zero4'; accepted: ddp, fsdp, zero1, zero2, zero3"):
        strategy("zero4")


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_config_accepts_what_the_row_says(name):
    row = TABLE[name]
    s = f"parallel.strategy={name}"
    assert accepted(s, "parallel.tp=2") == row.tp
    assert accepted(s, "parallel.pp=2", "train.grad_accum=2") == row.pp
    assert accepted(s, "train.compile=true") == row.compile
    assert accepted(s, "parallel.grad_compression=fp16") == row.grad_compression
    assert (
        accepted(s, "parallel.deepspeed_extra={zero_optimization: {stage3_param_persistence_threshold: 0}}") == row.deepspeed_json
    )
    for where in ("cpu", "nvme"):
        nvme = ["parallel.nvme_path=/tmp"] if where == "nvme" else []
        assert accepted(s, f"parallel.offload_optimizer={where}", *nvme) == (where in row.offload_optimizer)
        assert accepted(s, f"parallel.offload_params={where}", *nvme) == (where in row.offload_params)


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_layout_follows_the_rows_data_parallel_axis(name):
    row = TABLE[name]
    dims = parallel_dims(name, 4)
    assert (dims.dp_replicate, dims.dp_shard) == ((4, 1) if row.dp_axis == "replicate" else (1, 4))
    if row.hybrid:
        assert (parallel_dims(name, 4, dp_replicate=2).dp_replicate, parallel_dims(name, 4, dp_replicate=2).dp_shard) == (2, 2)
    else:
        with pytest.raises(UserError, match="dp_replicate=2 \\(hybrid sharding\\) needs parallel.strategy=fsdp"):
            parallel_dims(name, 4, dp_replicate=2)


def test_strategy_names_live_in_the_table_and_the_engines():
    """Outside strategies.py and engines/, no module compares with a strategy or format name
    (config's choices and defaults come from the table); what remains are other things that
    share a name (the deepspeed launcher and package), the two format readers' own names,
    the bench's own per-engine loops and peers, and the optimizers' entries' engines."""
    names = "|".join([*STRATEGIES, *FORMATS])
    pattern = re.compile(rf"""["']({names})["']""")
    allowed = {
        "checkpoint/dcp_format.py": {'name = "dcp"'},  # the reader of the format it is
        "checkpoint/deepspeed_format.py": {'name = "deepspeed"'},
        "launch/torchrun.py": {'opts.launcher == "deepspeed"'},  # `scaletrain launch --launcher deepspeed`
        "cli/launch.py": {'choices=["torchrun", "deepspeed"]'},
        "cli/cluster.py": {'args.launcher == "deepspeed"'},
        "launch/distributed.py": {'("scaletrain", "deepspeed")'},  # package versions in run.json
        "bench/report.py": {'["torch", "deepspeed"]'},
        # The bench's hand-written loops, one per engine module (the raw equivalents of
        # engines/), and which peers (HF Trainer, Accelerate) can drive which strategy.
        "bench/raw.py": {"LOOPS: dict["},
        "bench/runner.py": {"PEERS = {"},
        # An optimizer's entry names the engines that build it (data, as the table is).
        "optim/registry.py": {'strategies=("ddp", "fsdp")'},
    }
    found = {}
    for path in SRC.rglob("*.py"):
        rel = str(path.relative_to(SRC))
        if rel == "strategies.py" or rel.startswith("engines/"):
            continue
        for line in path.read_text().splitlines():
            code = line.split("#")[0]
            if pattern.search(code) and not any(ok in code for ok in allowed.get(rel, ())):
                found.setdefault(rel, []).append(line.strip())
    assert not found, found
