"""ParallelDims: layouts validated once, one-line errors naming the closest valid layout,
and the data-parallel view every component takes from it."""

from __future__ import annotations

import pytest

from scaletrain.config import load_config
from scaletrain.config.parallel import ParallelDims, dims_for, parallel_dims
from scaletrain.errors import UserError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "strategy, world, kw, want",
    [
        ("ddp", 4, {}, dict(dp_replicate=4, dp_shard=1)),
        ("fsdp", 4, {}, dict(dp_replicate=1, dp_shard=4)),
        ("fsdp", 4, {"dp_replicate": 2}, dict(dp_replicate=2, dp_shard=2)),
        ("zero3", 3, {}, dict(dp_replicate=1, dp_shard=3)),
        ("fsdp", 8, {"tp": 2}, dict(dp_replicate=1, dp_shard=4, tp=2)),
        ("fsdp", 8, {"dp_replicate": 2, "tp": 2}, dict(dp_replicate=2, dp_shard=2, tp=2)),
        ("ddp", 8, {"pp": 2, "tp": 2}, dict(dp_replicate=2, dp_shard=1, tp=2, pp=2)),
        ("ddp", 1, {}, dict(dp_replicate=1, dp_shard=1)),
    ],
)
def test_good_layouts(strategy, world, kw, want):
    dims = parallel_dims(strategy, world, **kw)
    assert dims == ParallelDims(**{"tp": 1, "pp": 1, **want})
    assert dims.world_size == world
    assert dims.dp_size == want["dp_replicate"] * want["dp_shard"]


@pytest.mark.parametrize(
    "strategy, world, kw, fragments",
    [
        (
            "fsdp",
            2,
            {"dp_replicate": 3},
            ["parallel.dp_replicate=3", "world size 2", "accepted: 1, 2", "closest valid layout: parallel.dp_replicate=2"],
        ),
        (
            "fsdp",
            12,
            {"dp_replicate": 5},
            ["parallel.dp_replicate=5", "data-parallel size 12", "closest valid layout: parallel.dp_replicate=4"],
        ),
        ("fsdp", 8, {"dp_replicate": 3, "tp": 2}, ["data-parallel size 4", "world size 8 / tp 2 / pp 1", "accepted: 1, 2, 4"]),
        (
            "ddp",
            4,
            {"dp_replicate": 2},
            ["parallel.dp_replicate=2", "needs parallel.strategy=fsdp, not ddp", "closest valid layout: parallel.dp_replicate=1"],
        ),
        (
            "fsdp",
            6,
            {"tp": 4},
            [
                "parallel.tp=4 x parallel.pp=1 = 4 does not divide the world size 6",
                "closest valid layout: parallel.tp=3 x parallel.pp=1",
            ],
        ),
        (
            "fsdp",
            8,
            {"tp": 2, "pp": 3},
            ["= 6 does not divide the world size 8", "closest valid layout: parallel.tp=2 x parallel.pp=2"],
        ),
    ],
)
def test_bad_layouts_are_one_line_naming_the_closest_valid_one(strategy, world, kw, fragments):
    with pytest.raises(UserError) as e:
        parallel_dims(strategy, world, **kw)
    message = str(e.value)
    assert "\n" not in message
    missing = [f for f in fragments if f not in message]
    assert not missing, f"{missing} not in {message!r}"


def test_ranks_map_to_coordinates_tp_innermost():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, pp=2)
    assert dims.world_size == 16
    assert dims.coordinates(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert dims.coordinates(1)["tp"] == 1 and dims.coordinates(2)["dp_shard"] == 1
    assert dims.coordinates(4)["dp_replicate"] == 1 and dims.coordinates(8)["pp"] == 1
    # Ranks that differ only in tp or pp share a data-parallel rank (they see the same data).
    assert [dims.dp_rank(r) for r in range(16)] == [0, 0, 1, 1, 2, 2, 3, 3] * 2
    assert sorted(set(dims.dp_rank(r) for r in range(16))) == list(range(dims.dp_size))
    with pytest.raises(ValueError):
        dims.coordinates(16)


def test_config_refuses_tp_and_pp_without_fsdp_and_dims_come_from_config():
    with pytest.raises(UserError, match="parallel.pp=2 needs parallel.strategy=fsdp .*not ddp; accepted: strategy fsdp"):
        load_config([], ["parallel.pp=2"])
    with pytest.raises(UserError, match="parallel.tp=2 needs parallel.strategy=fsdp .*not zero3; accepted: strategy fsdp"):
        load_config([], ["parallel.tp=2", "parallel.strategy=zero3"])
    tp = load_config([], ["parallel.strategy=fsdp", "parallel.tp=2"])
    assert dims_for(tp.parallel, 8).as_dict() == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2, "dp_size": 4}
    cfg = load_config([], ["parallel.strategy=fsdp", "parallel.dp_replicate=2"])
    assert dims_for(cfg.parallel, 6).as_dict() == {"pp": 1, "dp_replicate": 2, "dp_shard": 3, "cp": 1, "tp": 1, "dp_size": 6}
