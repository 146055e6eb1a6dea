"""Acceptance: predicted peaks agree with measured ones (CPU, MemTracker) within 15%.

Each case runs `scaletrain plan --measure` exactly as a user would: two real steps of
the configured engine at the given world size, compared with the planner's prediction.
docs/planner.md records the errors these give.
"""

from __future__ import annotations

import functools
import json
import sys

import pytest

from helpers.launch import check, run, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.equivalence]

SMALL = ["model.preset=small", "data.seq_len=256"]
CASES = [
    # (world, overrides): engines x sizes x micro-batch x activation checkpointing x precision
    (1, ["model.preset=tiny", "data.seq_len=128", "train.micro_batch=16"]),
    (1, ["model.preset=small", "data.seq_len=32", "train.micro_batch=1"]),  # peak at the end of backward
    # Selective checkpointing (models/selective_ac.py): each block keeps its input and the outputs
    # of wq, wv, w1, w2 and the attention (measured here 252.1 MiB, predicted 252.1; full AC
    # 176.7, none 405.2), so a wrong kept set moves the peak by tens of MiB.
    (
        1,
        [
            "model.preset=small",
            "data.seq_len=512",
            "train.micro_batch=4",
            "parallel.activation_checkpointing=true",
            "parallel.ac_mode=selective",
        ],
    ),
    # Micro-batch 4 at world 2 (8 took ~45 s each under the suite's load): the same engines'
    # sharded checkpointed blocks, half the compute.
    (2, [*SMALL, "train.micro_batch=4", "parallel.strategy=fsdp", "parallel.activation_checkpointing=true"]),
    # bf16 matmuls are slow on CPUs without bf16 units: a shorter sequence keeps this quick.
    (2, ["model.preset=small", "data.seq_len=64", "train.micro_batch=4", "parallel.strategy=fsdp", "precision=bf16"]),
    (2, [*SMALL, "train.micro_batch=4", "parallel.strategy=zero3", "parallel.activation_checkpointing=true"]),
    # ZeRO-2 allocates two full-size reduce buckets (overlap_comm) inside backward only: 381
    # of its 487 MiB here, so a wrong bucket term fails this: one bucket -40%, buckets held
    # for the whole step (the loss's temporaries beside them) +19%.
    (2, ["model.preset=tiny", "data.seq_len=128", "train.micro_batch=16", "parallel.strategy=zero2"]),
    (2, [*SMALL, "train.micro_batch=4", "parallel.strategy=zero1"]),  # one bucket; whole gradients in backward
    # bf16: buckets in the weights' dtype (ZeRO-1/2 in backward only, ZeRO-3's resident).
    (2, ["model.preset=small", "data.seq_len=64", "train.micro_batch=4", "parallel.strategy=zero2", "precision=bf16"]),
    (2, ["model.preset=small", "data.seq_len=64", "train.micro_batch=4", "parallel.strategy=zero3", "precision=bf16"]),
    # Ulysses sequence parallel: each rank's positions, all heads' attention over the whole
    # sequence for its share of heads (measured here: fsdp 215.6 MiB, predicted 212.6, -1.4%;
    # zero3 441.3, predicted 420.8, -4.6%).
    (
        2,
        [
            "model.preset=small",
            "data.seq_len=1024",
            "train.micro_batch=2",
            "parallel.strategy=fsdp",
            "parallel.cp=2",
            "parallel.cp_mode=ulysses",
        ],
    ),
    (
        2,
        [
            "model.preset=small",
            "data.seq_len=1024",
            "train.micro_batch=2",
            "parallel.strategy=zero3",
            "parallel.cp=2",
            "parallel.cp_mode=ulysses",
        ],
    ),
    # A mixture of experts under Ulysses with expert parallel over the cp ranks (ep 2 = cp 2:
    # each rank holds half the experts; measured here 165.1 MiB, predicted 166.4, +0.8%).
    (
        2,
        [
            "model.preset=tiny-moe",
            "model.moe.experts_impl=loop",  # one kernel on every CPU
            "data.seq_len=1024",
            "train.micro_batch=2",
            "parallel.strategy=fsdp",
            "parallel.cp=2",
            "parallel.cp_mode=ulysses",
            "parallel.ep=2",
        ],
    ),
    # A Hugging Face Llama under Ulysses (its attention through transformers' interface,
    # models/ulysses.py; the planner traces the HF blocks at T/cp): measured 60.0 MiB,
    # predicted 60.0 (+0.0%).
    (
        2,
        [
            "model.source=hf",
            "model.hf_config={model_type: llama, hidden_size: 256, num_hidden_layers: 4, num_attention_heads: 4, "
            "num_key_value_heads: 2, intermediate_size: 688, vocab_size: 512, max_position_embeddings: 4096}",
            "data.seq_len=2048",
            "train.micro_batch=1",
            "parallel.strategy=fsdp",
            "precision=fp32",
            "parallel.activation_checkpointing=true",
            "parallel.cp=2",
            "parallel.cp_mode=ulysses",
        ],
    ),
]
# 28-60 s each under the suite's load (world 2): `slow`, run by `make test-slow` and
# `make test-numerics` (docs/planner.md). Of the world-2 cases zero2 at the tiny size
# (case 6, DeepSpeed's buckets) and the context-parallel ones (10-13) run without the mark.
SLOW = {3, 4, 5, 7, 8, 9}


def _case_id(world: int, overrides: list[str]) -> str:
    return f"w{world}-" + "-".join(o.split("=")[1] for o in overrides)


@functools.cache
def _measure(world: int, overrides: tuple[str, ...]) -> str:
    args = ["-m", "scaletrain", "plan", "--measure", "--json", "run.device=cpu", *overrides]
    proc = check(run([sys.executable, *args] if world == 1 else torchrun(args, world), timeout=240))
    return proc.stdout.strip().splitlines()[-1]


def measure(world: int, overrides: list[str]) -> dict:
    """Measured once per layout in this session (the chunked-loss test reuses a case's)."""
    return json.loads(_measure(world, tuple(overrides)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world, overrides",
    [pytest.param(w, ov, id=_case_id(w, ov), marks=[pytest.mark.slow] if i in SLOW else []) for i, (w, ov) in enumerate(CASES)],
)
def test_predicted_peak_within_15_percent_of_measured(world, overrides):
    result = measure(world, overrides)
    predicted, measured = result["predicted"], result["measured"]
    error = predicted["peak"] / measured["peak"] - 1
    print(
        f"{result['strategy']} world {world}: predicted {predicted['peak'] / 2**20:.1f} MiB, measured {measured['peak'] / 2**20:.1f} MiB, {100 * error:+.1f}%"
    )
    assert abs(error) <= 0.15
    # Model states are exact quantities, not estimates: check them on their own (MemTracker
    # files DeepSpeed's fp32 master partition outside its optimizer category: moments only).
    if not result["strategy"].startswith("zero"):
        assert predicted["optimizer"] == pytest.approx(measured["optimizer"], rel=0.02)


@pytest.mark.timeout(300)
def test_chunked_loss_lowers_the_measured_peak_as_predicted():
    # fp32 (bf16 matmuls take a minute here): the logits exist in fp32 anyway, so the
    # chunked loss saves only backward's fp32 temporary, less a chunk's: the planner
    # predicts 198.3 -> 174.3 MiB, MemTracker measured 198.2 -> 174.3 (bytes counted, not
    # sampled: the same every run). In bf16 the saving is larger (docs/planner.md).
    base = CASES[0][1]  # tiny, 16 x 128
    plain, chunked = measure(1, base), measure(1, [*base, "train.loss_chunk_tokens=256"])
    saved = 1 - chunked["measured"]["peak"] / plain["measured"]["peak"]
    assert saved > 0.1, f"measured peak {plain['measured']['peak'] / 2**20:.1f} -> {chunked['measured']['peak'] / 2**20:.1f} MiB"
    assert abs(chunked["predicted"]["peak"] / chunked["measured"]["peak"] - 1) <= 0.15
    # Under tiles the loss runs the head a tile at a time, or a chunk at a time where that is
    # fewer positions (models/loss.py): a vocabulary of 16,384, tiles of 512, chunks of 128:
    # measured 343.1 -> 278.4 MiB, predicted 327.5 -> 256.5 (-4.5%, -7.9%).
    tiled = ["model.preset=small", "data.seq_len=1024", "train.micro_batch=2", "parallel.strategy=fsdp", "precision=fp32",
             "data.vocab_size=16384", "train.tile_tokens=512"]  # fmt: skip
    plain, chunked = measure(1, tiled), measure(1, [*tiled, "train.loss_chunk_tokens=128"])
    assert chunked["measured"]["peak"] < 0.85 * plain["measured"]["peak"]
    for result in (plain, chunked):
        assert abs(result["predicted"]["peak"] / result["measured"]["peak"] - 1) <= 0.15


@pytest.mark.timeout(300)
def test_tiles_lower_the_measured_peak_as_predicted_within_10_percent():
    # train.tile_tokens (models/feed_forward.py, models/moe.py, models/loss.py HeadTiles): the
    # feed-forward's hidden activations (a mixture of experts': its slots and the experts'
    # hidden ones) and the logits held for one tile at a time, without and with activation
    # checkpointing. Measured here, the small preset: 412.1 -> 194.4 and 119.0 MiB,
    # predicted 415.5 -> 195.5 and 126.1 (+0.6%, +6.0%); tiny-moe (the loop kernel): 325.4
    # -> 121.1 and 112.0, predicted 330.5 -> 124.4 and 111.7 (+2.8%, -0.3%): within the
    # issue's 10%.
    for model in ("model.preset=small", "model.preset=tiny-moe"):
        base = [model, "data.seq_len=1024", "train.micro_batch=2", "parallel.strategy=fsdp", "precision=fp32"]
        if model.endswith("moe"):
            base.append("model.moe.experts_impl=loop")  # one kernel on every CPU (auto takes the grouped one where a probe runs)
        plain = measure(1, base)
        for extra in (["train.tile_tokens=128"], ["train.tile_tokens=128", "parallel.activation_checkpointing=true"]):
            tiled = measure(1, [*base, *extra])
            assert tiled["measured"]["peak"] < 0.6 * plain["measured"]["peak"], extra
            assert abs(tiled["predicted"]["peak"] / tiled["measured"]["peak"] - 1) <= 0.10, (extra, tiled)
