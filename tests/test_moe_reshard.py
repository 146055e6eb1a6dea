"""A mixture of experts moves between expert-parallel layouts, world sizes and engines
mid-training (issue 27, item 4), the way tests/test_reshard.py moves a dense model.

One run directory is trained 2 steps at a time, each link on another layout, killed right
after its checkpoint and resumed on the next: world 4 with ep 2 (2 ranks hold each half of
the experts, their weights FSDP-sharded over the other 2), then world 2 with ep 2 (DCP
resharding of the expert DTensors), world 1 without ep (ep 2 -> 1), zero3 at world 2 (the
DCP checkpoint converted into DeepSpeed's), and back to fsdp with ep 2 from DeepSpeed's.
All 10 steps must equal one process trained straight through (loss and grad norm every
step, the final weights), with the standing tolerances (helpers/numerics.py).

Every layout keeps micro-batches of 2 samples (global batch 8, the accumulation making up
the rest): the routers' balance term is computed per micro-batch, so only micro-batches of
the same samples give the same loss (the loader cuts the global batch into the same
consecutive micro-batches at any world size).
"""

from __future__ import annotations

import pytest

from helpers.launch import check, train
from helpers.numerics import assert_same_training
from helpers.runs import base_overrides, eval_overrides, train_through

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

MOE = ["model.preset=tiny-moe", "train.global_batch=8", "train.micro_batch=2"]
# (strategy, world size, ep) of each link of 2 steps.
CHAIN = [
    ("fsdp", 4, 2),  # ep 2 x 2 data-parallel ranks per expert group
    ("fsdp", 2, 2),  # world 4 -> 2 at the same ep
    ("fsdp", 1, 1),  # ep 2 -> 1
    ("zero3", 2, 1),  # fsdp -> ZeRO-3 (through the engine-neutral state)
    ("fsdp", 2, 2),  # ZeRO-3 -> fsdp with ep 2
]
STEPS = 2 * len(CHAIN)


def _eval(data, world: int) -> list[str]:
    # Evaluated after each link's last step, before its checkpoint: the same 8 sequences per
    # global eval batch at every world size (the cross entropy alone, so how they are cut
    # into micro-batches does not matter, unlike the training loss's balance term).
    return [*eval_overrides(data, every=2), f"eval.micro_batch={8 // world}"]


@pytest.fixture(scope="module")
def straight(small_dataset, tmp_path_factory):
    run = tmp_path_factory.mktemp("moe-straight") / "run"
    check(train([*base_overrides(small_dataset, run, steps=STEPS), *MOE, *_eval(small_dataset, 1), f"checkpoint.every={STEPS}"]))
    return run


@pytest.mark.timeout(600)
def test_experts_move_between_ep_world_sizes_and_engines(small_dataset, straight, tmp_path):
    run = tmp_path / "run"
    base = [*base_overrides(small_dataset, run, steps=STEPS), *MOE, "checkpoint.every=2"]
    links = [
        (
            [*base, *_eval(small_dataset, world), f"parallel.strategy={strategy}", f"parallel.ep={ep}"],
            world,
            f"{strategy} at world {world}" + (f" (ep {ep})" if ep > 1 else ""),
        )
        for strategy, world, ep in CHAIN
    ]
    train_through(run, links, every=2)
    assert_same_training(run, straight, steps=STEPS)
