"""train.activation_offload (engines/offload.py): the tensors a forward saves for backward
held on the host; and train.tile_tokens (models/feed_forward.py), the feed-forward over
tiles recomputed in backward. Offload (with copy=True, each tensor copied and back, as a
GPU's would be): A backward through them gives the gradients of the plain one bit for
bit; under activation checkpointing what moves is the blocks' inputs and what the head
and loss save, nothing of the blocks' insides; parameters never move. Runs with it (zero2
with checkpointing, fsdp without, world 2) equal the same runs without it bit for bit
(on a CPU nothing moves: the host is the device), and their rows say how many bytes
each step would hold on a GPU's host. Tiles: the feed-forward's
output and gradients as untiled, none of its hidden activations saved whole; zero3 and
fsdp runs with tiles (with checkpointing and offload) equal the plain run."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from scaletrain.engines.offload import ActivationOffload
from scaletrain.models import build_model, loss_fn
from scaletrain.models.feed_forward import FeedForward
from scaletrain.models.presets import ModelShape

from helpers.launch import check, train
from helpers.numerics import assert_same_training
from helpers.runs import base_overrides, metric_rows

B, T, DIM, LAYERS, VOCAB = 2, 128, 128, 3, 512


def _shape(layers: int) -> ModelShape:
    return ModelShape(VOCAB, DIM, layers, n_heads=4, n_kv_heads=2, ffn_dim=384, tie_embeddings=True, rope_theta=1e4,
                      norm_eps=1e-5)  # fmt: skip


def _backward(checkpointed: bool, offload: ActivationOffload | None) -> dict[str, torch.Tensor]:
    model = build_model(_shape(LAYERS), T, seed=0)
    if checkpointed:
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(1))
    with offload() if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


class Recording(ActivationOffload):
    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), copy=True)  # each tensor copied and back, as to a GPU's host
        self.shapes: list[tuple[int, ...]] = []

    def _pack(self, tensor: torch.Tensor) -> object:
        packed = super()._pack(tensor)
        if packed is not tensor:
            self.shapes.append(tuple(tensor.shape))
        return packed


@pytest.mark.unit
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_backward_through_host_held_tensors_is_the_plain_one(checkpointed):
    plain = _backward(checkpointed, None)
    offload = Recording()
    held = _backward(checkpointed, offload)
    assert held.keys() == plain.keys()
    for name in plain:
        assert torch.equal(held[name], plain[name]), name  # the same numbers, copied and back
    tensors, size = offload.moved()
    assert tensors == len(offload.shapes) > 0 and offload.moved() == (0, 0)  # read once
    # The backward asks for the tensors about in reverse: each one it asks for brings the
    # one saved before it back ahead of time. Checkpointed, exactly in reverse: all but the
    # first asked were back already (each block's input while the block after it ran
    # backward); without, most (seen: 53 of 66). Once the graph is gone so is every host copy.
    if checkpointed:
        assert offload.prefetched == tensors - 1
    else:
        assert offload.prefetched > tensors // 2
    assert offload._order and all(ref() is None for ref in offload._order)
    residual = (B, T, DIM)
    weights = {tuple(p.shape) for p in build_model(_shape(1), T, seed=0).parameters()}
    assert not weights & set(offload.shapes)  # no parameter moved (none has an activation's shape here)
    if checkpointed:
        # Each block saves its input, the residual stream; the rest is the head's and the loss's.
        assert offload.shapes.count(residual) >= LAYERS
        assert (B, T, 384) not in offload.shapes  # no feed-forward activation: recomputed, not held
    else:
        assert (B, T, 384) in offload.shapes  # the feed-forward's activations held on the host
    assert size == sum(4 * torch.Size(s).numel() for s in offload.shapes)


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "layout",
    [["parallel.strategy=zero2", "parallel.activation_checkpointing=true"], ["parallel.strategy=fsdp"]],
    ids=["zero2-checkpointed", "fsdp"],
)
def test_runs_with_activation_offload_equal_runs_without(small_dataset, tmp_path, layout):
    runs = {}
    for offload in (False, True):
        run = tmp_path / str(offload)
        extra = [*layout, "train.micro_batch=1", "train.grad_accum=2", f"train.activation_offload={str(offload).lower()}"]
        check(train([*base_overrides(small_dataset, run, steps=4), *extra], nproc=2))
        runs[offload] = metric_rows(run)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in runs[True]] == [r[key] for r in runs[False]], key
    moved = [r["offloaded_bytes"] for r in runs[True]]
    assert len(set(moved)) == 1 and moved[0] > 0  # every step the same tensors
    assert "offloaded_bytes" not in runs[False][0]


@pytest.mark.e2e
def test_what_offload_is_not_checked_with_is_one_line(small_dataset, tmp_path, capsys):
    from scaletrain.cli import main

    base = ["train", f"run.dir={tmp_path / 'run'}", f"data.paths={small_dataset}", "run.device=cpu"]
    base += ["train.activation_offload=true", "parallel.strategy=fsdp"]
    for extra, given in (
        (["parallel.pp=2", "train.grad_accum=2"], "parallel.pp=2"),
        (["train.compile=true"], "train.compile=true"),
    ):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"scaletrain: error: config: train.activation_offload does not combine with {given} (not checked yet); accepted: train.activation_offload=false"
        ]


@pytest.mark.unit
def test_a_tiled_feed_forward_is_the_whole_one_and_saves_no_whole_hidden_activation():
    torch.manual_seed(0)
    ffn = FeedForward(DIM, 384)
    x = torch.randn(B, T, DIM, requires_grad=True)
    whole = ffn(x)
    grads = torch.autograd.grad(whole.square().sum(), [x, *ffn.parameters()])
    ffn.tile_tokens = 48  # 128 positions: tiles of 48, 48 and 32
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        tiled = ffn(x)
    tiled_grads = torch.autograd.grad(tiled.square().sum(), [x, *ffn.parameters()])
    # Each position's row goes through the same products; a matmul over fewer rows may
    # block its inner sums otherwise: fp32 rounding of sums of 128-384 terms (~1e-6 relative
    # of the terms, as test_gradients.py derives), the weights' gradients summed tile by tile.
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-6)
    for got, want in zip(tiled_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert not [s for s in saved if s[-1] == 384]  # the hidden activations: recomputed per tile, never held
    assert saved.count((B, 48, DIM)) == 2 and saved.count((B, 32, DIM)) == 1  # what each tile's checkpoint keeps


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_runs_with_tiles_equal_the_plain_run(small_dataset, tmp_path):
    plain = tmp_path / "plain"
    common = ["data.seq_len=256", "train.micro_batch=2", "eval.every=0"]
    check(train([*base_overrides(small_dataset, plain, steps=6), *common, "parallel.strategy=fsdp"], nproc=2))
    # Offload beside the tiles shows what the forward saved: without checkpointing, less
    # by the feed-forwards' hidden activations when they are tiled.
    offload = "train.activation_offload=true"
    layouts = {
        "zero3-tiled": ["parallel.strategy=zero3", "train.tile_tokens=64", offload],
        "zero3": ["parallel.strategy=zero3", offload],
        "fsdp-checkpointed-tiled": ["parallel.strategy=fsdp", "train.tile_tokens=96",
                                    "parallel.activation_checkpointing=true", offload],
    }  # fmt: skip
    for name, extra in layouts.items():
        check(train([*base_overrides(small_dataset, tmp_path / name, steps=6), *common, *extra], nproc=2))
        assert_same_training(tmp_path / name, plain, steps=6, evals=False)
    held = {name: metric_rows(tmp_path / name)[0]["offloaded_bytes"] for name in layouts}
    # Untiled, each block's feed-forward saves 4 tensors [2, 256, 384] (w1's and w3's outputs,
    # silu's, their product) in fp32; 4 blocks, one micro-batch a step: at least 3 of them gone.
    hidden = 3 * 2 * 256 * 384 * 4 * 4
    assert held["zero3"] - held["zero3-tiled"] >= hidden


@pytest.mark.e2e
def test_tiles_where_they_are_not_built_are_one_line(small_dataset, tmp_path, capsys):
    from scaletrain.cli import main

    base = ["train", f"run.dir={tmp_path / 'run'}", f"data.paths={small_dataset}", "run.device=cpu", "train.tile_tokens=64"]
    for extra, says in (
        (
            ["model.preset=tiny-moe", "model.moe.capacity_factor=1.25"],
            "train.tile_tokens does not combine with model.moe.capacity_factor=1.25 (a capacity keeps each expert's first",
        ),
        (
            ["parallel.strategy=fsdp", "parallel.pp=2", "train.grad_accum=2"],
            "train.tile_tokens does not combine with parallel.pp=2",
        ),
    ):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err


@pytest.mark.unit
def test_the_head_and_loss_in_tiles_are_the_whole_loss_and_hold_no_whole_logits():
    from scaletrain.models.feed_forward import tile
    from scaletrain.models.loss import IGNORE_INDEX, HeadTiles

    model = build_model(_shape(2), T, seed=0)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(2))
    targets = tokens[:, 1:].clone()
    targets[:, : T // 3] = IGNORE_INDEX  # a fine-tuning prompt: not trained, not counted

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor], list[tuple[int, ...]]]:
        model.zero_grad()
        saved: list[tuple[int, ...]] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            loss = loss_fn(model(tokens[:, :-1]), targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved

    whole, grads, saved = run()
    assert tile(model, 48) == 2  # two blocks' feed-forwards, and the model's head
    assert isinstance(model(tokens[:, :-1]), HeadTiles)
    tiled, tiled_grads, tiled_saved = run()
    # The same sums of the same rows, the head's weight gradient summed over tiles: fp32
    # rounding of sums of up to 256 positions' terms (as test_gradients.py derives).
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=0)
    for name in grads:
        torch.testing.assert_close(tiled_grads[name], grads[name], rtol=1e-5, atol=1e-5 * grads[name].abs().max().item())
    assert any(s[-1:] == (VOCAB,) and s[0] == B * T for s in saved)  # whole: the logits kept for backward
    assert not any(s[-1:] == (VOCAB,) for s in tiled_saved)  # tiled: no logits held, each tile recomputed


@pytest.mark.unit
def test_the_loss_tiles_are_the_loss_chunks_where_those_are_fewer_positions():
    # train.loss_chunk_tokens under tiles (a large vocabulary gets both by default): the head
    # and the loss run on chunks of 20 positions, not the feed-forward's tiles of 48, so no
    # more than 20 positions' logits exist at a time; the loss is the same mean.
    from scaletrain.models.feed_forward import tile
    from scaletrain.models.loss import HeadTiles

    model = build_model(_shape(2), T, seed=0)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(3))
    whole = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    tile(model, 48)
    rows: list[int] = []
    model.output.register_forward_hook(lambda _m, _i, out: rows.append(out.reshape(-1, VOCAB).shape[0]))
    out = model(tokens[:, :-1])
    assert isinstance(out, HeadTiles)
    chunked = loss_fn(out, tokens[:, 1:], chunk_tokens=20)
    # fp32 sums of the same rows' terms over other groupings: rounding of up to 256 terms.
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    assert max(rows) == 20 and sum(rows) == B * T  # every position once, 20 at a time
    rows.clear()
    chunked.backward()  # each chunk's head recomputed under its checkpoint, 20 positions again
    assert max(rows) == 20 and sum(rows) == B * T


@pytest.mark.unit
@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_tiled_experts_are_the_whole_layer_and_save_no_whole_slots(impl):
    from scaletrain.config import load_config
    from scaletrain.models.moe import MoE
    from scaletrain.models.presets import resolve_shape

    # top 2 of 8 experts, a shared expert beside them (tiled too: a FeedForward), hidden 96.
    overrides = ["model.preset=tiny-moe", "model.dim=32", "model.n_heads=2", "model.n_kv_heads=2",
                 "model.moe.shared_experts=1", "model.moe.expert_ffn_dim=96", f"model.moe.experts_impl={impl}"]  # fmt: skip
    layer = MoE(resolve_shape(load_config([], overrides).model, 64))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(B, 40, 32, requires_grad=True)
    whole, aux, stats = layer(x)
    grads = torch.autograd.grad(whole.square().sum() + aux, [x, *layer.parameters()])
    layer.tile_tokens = layer.shared.tile_tokens = 16  # 40 positions: tiles of 16, 16 and 8
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        tiled, tiled_aux, tiled_stats = layer(x)
    tiled_grads = torch.autograd.grad(tiled.square().sum() + tiled_aux, [x, *layer.parameters()])
    # The routing is the whole layer's (the same scores: the same experts, the same balance
    # and z terms, bit for bit); each token's experts run on fewer rows at a time, a matmul
    # over other row counts may block its inner sums otherwise (fp32 rounding of sums of
    # 32-96 terms), and each weight's gradient is summed tile by tile.
    assert torch.equal(tiled_aux, aux) and torch.equal(tiled_stats, stats)
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-6)
    for got, want in zip(tiled_grads, grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # Whole, the experts keep their slots [B x 40 x 2, dim] and hidden activations
    # [.., 96]; tiled, nothing of the experts' width, nor any slot, exists for backward.
    slots = B * 40 * 2
    assert not [s for s in saved if s[-1] == 96 or s[0] == slots], saved
    assert saved.count((B, 16, 32)) == 2 and saved.count((B, 8, 32)) == 1  # each routed tile's checkpoint keeps its view


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_mixture_of_experts_runs_with_tiles_equal_the_plain_run(small_dataset, tmp_path):
    """tiny-moe (sequence-wise balance and the expert bias: both count the whole routing),
    fsdp with expert parallel 2 at world 2 (each tile's slots travel to their experts' rank
    and back, again in the recomputing backward), with tiles, with and without checkpointing,
    equal to the plain run."""
    common = ["model.preset=tiny-moe", "model.moe.balance=bias", "data.seq_len=128", "train.micro_batch=4",
              "eval.every=0", "parallel.strategy=fsdp", "parallel.ep=2"]  # fmt: skip
    offload = "train.activation_offload=true"  # which shows what the forward saved
    layouts = {"plain": [offload], "tiled": ["train.tile_tokens=48", offload],
               "checkpointed-tiled": ["train.tile_tokens=32", "parallel.activation_checkpointing=true"]}  # fmt: skip
    for name, extra in layouts.items():
        check(train([*base_overrides(small_dataset, tmp_path / name, steps=6), *common, *extra], nproc=2))
        if name != "plain":
            assert_same_training(tmp_path / name, tmp_path / "plain", steps=6, evals=False)
    held = {name: metric_rows(tmp_path / name)[0]["offloaded_bytes"] for name in ("plain", "tiled")}
    # Untiled, each MoE layer's experts save 4 hidden tensors [slots, 384] (w1's and w3's
    # outputs, silu's, their product) in fp32, 4 x 128 x 2 slots a micro-batch and rank on
    # average (ep moves them between the ranks): at least 3 of the 4 layers' gone.
    hidden = 3 * 4 * 4 * 128 * 2 * 384 * 4
    assert held["plain"] - held["tiled"] >= hidden, held
