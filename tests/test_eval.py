"""Evaluation (training/evaluation.py, data/heldout.py, training/eval_checkpoint.py): the held-out split by
document, the eval set and its refusals, what an engine's evaluate returns, and `scaletrain
eval` of a final checkpoint at world 1 and 2. Every engine's eval rows against one
process's are in the equivalence tests (helpers.numerics.assert_same_evals), LoRA's and a
teacher's against the checkpoint's own loss in test_lora.py and test_distill.py."""

from __future__ import annotations

import json
import re
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.config import load_config
from scaletrain.data import PackedTokens, RankBatches, prepare_dataset
from scaletrain.data.heldout import Windows, held_out
from scaletrain.engines.base import AccumulationWindow
from scaletrain.errors import UserError
from scaletrain.launch.distributed import ALONE
from scaletrain.models.presets import resolve_shape
from scaletrain.models.spec import LlamaSpec
from scaletrain.telemetry.metrics import read_metrics
from scaletrain.training.eval_checkpoint import checkpoint_config
from scaletrain.training.evaluation import eval_loss, open_eval_set

from helpers.launch import check, scaletrain, train
from helpers.runs import base_overrides, checkpoint_model, eval_rows, loss_of

SEQ = 29
SEED = 7


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """300 documents of 20-200 words in small shards: documents cross shard boundaries."""
    src = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "return", "value", "index", "eval", "train", "split"]
    lines = [json.dumps({"text": f"doc {i}: " + " ".join(rng.choice(words, rng.integers(20, 200)))}) for i in range(300)]
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path_factory.mktemp("docs-data") / "ds"
    return prepare_dataset([str(src)], out, vocab_size=300, shard_tokens=1024, show_progress=False)


def stream_of(dataset) -> tuple[np.ndarray, list[np.ndarray]]:
    """The manifest-order token stream and its shards, read from the files."""
    m = json.loads((dataset / "manifest.json").read_text())
    shards = [np.fromfile(dataset / s["file"], dtype=m["dtype"]).astype(np.int64) for s in m["shards"]]
    return np.concatenate(shards), shards


@pytest.mark.unit
def test_documents_are_held_out_whole_and_training_never_reads_them(documents):
    data = PackedTokens(documents, SEQ, SEED, held_out=0.2)
    stream, shards = stream_of(documents)
    # Document i: the tokens after the (i-1)-th eos up to and including the i-th.
    doc = np.concatenate([[0], np.cumsum(stream == data.eos_id)[:-1]])
    held = held_out(np.arange(doc[-1] + 1), SEED, 0.2)[doc]
    assert data.split.documents == 300 and 30 < data.split.held_documents < 90  # 60 expected
    assert data.split.held_documents == len(np.unique(doc[held]))
    # Whole documents on each side, each side in document order.
    np.testing.assert_array_equal(np.concatenate(data.documents(held=True)), stream[held])
    np.testing.assert_array_equal(np.concatenate(data.documents(held=False)), stream[~held])
    # Every training window of two epochs: today's layout (the epoch's shard order) with
    # the held-out tokens cut out of each shard, and nothing else.
    shard_held = np.split(held, np.cumsum([len(s) for s in shards])[:-1])
    for epoch in (0, 1):
        train_stream = np.concatenate([shards[i][~shard_held[i]] for i in data.shard_order(epoch)])
        idx = np.arange(epoch * data.samples_per_epoch, (epoch + 1) * data.samples_per_epoch)
        want = [train_stream[w * SEQ : w * SEQ + SEQ + 1] for w in (data.sample_id(int(g))[1] for g in idx)]
        np.testing.assert_array_equal(data.batch(idx), np.stack(want))
    assert data.samples_per_epoch == (int((~held).sum()) - 1) // SEQ


@pytest.mark.unit
def test_the_split_is_the_same_at_any_world_size_and_nested_by_fraction(documents):
    data = PackedTokens(documents, SEQ, SEED, held_out=0.2)
    # The choice of each document needs nothing but its index and the seed.
    every = held_out(np.arange(300), SEED, 0.2)
    assert all(held_out(np.array([i]), SEED, 0.2)[0] == every[i] for i in range(0, 300, 7))
    assert not np.array_equal(held_out(np.arange(300), SEED + 1, 0.2), every)
    # A smaller fraction holds out a subset: `scaletrain eval` may lower eval.split.
    assert (held_out(np.arange(300), SEED, 0.05) <= every).all() and held_out(np.arange(300), SEED, 0.05).any()
    # The global stream is the same whatever the data-parallel size reading it.
    steps = 3
    one = RankBatches(data, 6, 1, 0, 1)
    got1 = [torch.cat([x for x, _ in one.next_step()]) for _ in range(steps)]
    for dp in (2, 3):
        ranks = [RankBatches(data, 6 // dp, 1, r, dp) for r in range(dp)]
        for s in range(steps):
            assert torch.equal(torch.cat([r.next_step()[0][0] for r in ranks]), got1[s])
    # Off (the default): no split at all, the stream as it always was (test_data_loader.py
    # reconstructs it from the files; test_checkpoint_compat.py resumes a saved run on it).
    assert load_config([], ["eval.every=0"]).eval.held_out == 0.0
    plain = PackedTokens(documents, SEQ, SEED)
    assert plain.split is None and plain.samples_per_epoch == (plain.total_tokens - 1) // SEQ


@pytest.mark.unit
def test_the_eval_set_and_what_it_refuses(documents):
    data = PackedTokens(documents, SEQ, SEED, held_out=0.1)
    cfg = load_config([], [f"data.seq_len={SEQ}", "eval.every=4", "eval.split=0.1", "eval.batches=3", "train.micro_batch=2"])
    evalset = open_eval_set(cfg, ALONE, data, 1)
    # The first batches x global batch windows of the held-out documents, in order; each
    # rank its contiguous share of each eval batch, in micro-batches.
    windows = Windows(data.documents(held=True), SEQ)
    assert (evalset.samples, evalset.tokens) == (6, 6 * SEQ)
    first = [torch.cat([x for x, _ in b]) for b in evalset.rank_batches(0, 1)]
    halves = [[torch.cat([x for x, _ in b]) for b in evalset.rank_batches(r, 2)] for r in (0, 1)]
    assert [len(b) for b in first] == [2, 2, 2]
    for b in range(3):
        assert torch.equal(first[b], torch.from_numpy(windows.batch(range(2 * b, 2 * b + 2))[:, :-1]))
        assert torch.equal(torch.cat([halves[0][b], halves[1][b]]), first[b])
    fits = windows.count // 2
    with pytest.raises(
        UserError, match=rf"eval.batches=100000 needs 200000 windows .* holds {windows.count}; accepted: eval.batches <= {fits}"
    ):
        open_eval_set(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"batches": 100_000})}), ALONE, data, 1)
    pp = ["parallel.strategy=fsdp", "parallel.pp=2", "train.grad_accum=2", "model.tie_embeddings=false"]
    with pytest.raises(UserError, match="eval.micro_batch=2 with parallel.pp=2: a pipeline evaluates with its schedule's"):
        open_eval_set(load_config([], [*pp, "eval.every=4", "eval.micro_batch=2"]), ALONE, data, 1)
    with pytest.raises(UserError, match="pp_schedule=zbv: torch 2.13's eval path .* accepted: parallel.pp_schedule=gpipe|1f1b"):
        open_eval_set(load_config([], [*pp, "eval.every=4", "parallel.pp_schedule=zbv"]), ALONE, data, 1)
    with pytest.raises(
        UserError,
        match="nothing to evaluate on: eval.split=0 held no training document out; accepted: eval.data=PATHS, eval.data=train",
    ):
        open_eval_set(load_config([], []), ALONE, PackedTokens(documents, SEQ, SEED), 1)


@pytest.mark.unit
def test_eval_batches_left_unset_take_what_the_split_holds_and_a_number_set_does_not(documents):
    """issue 60: `scaletrain train eval.every=100` on the embedded default refused its own
    defaults (8 batches, a 1% split holding 5). Unset: up to 8, what the data holds, said;
    a number the data cannot hold: the one-line error, as before."""
    data = PackedTokens(documents, SEQ, SEED, held_out=0.1)
    windows = Windows(data.documents(held=True), SEQ).count
    g = 2 * windows // 5  # a global batch that leaves room for two of them
    cfg = load_config([], [f"data.seq_len={SEQ}", "eval.every=4", "eval.split=0.1", f"train.micro_batch={g}"])
    assert cfg.eval.batches is None
    evalset = open_eval_set(cfg, ALONE, data, 1)
    assert evalset.batches == windows // g == 2 and "eval: 2 global batches" in evalset.note and "up to 8" in evalset.note
    enough = load_config([], [f"data.seq_len={SEQ}", "eval.every=4", "eval.split=0.1", "train.micro_batch=1"])
    assert (open_eval_set(enough, ALONE, data, 1).batches, open_eval_set(enough, ALONE, data, 1).note) == (8, "")
    with pytest.raises(UserError, match=rf"eval.batches=3 needs {3 * g} windows .* accepted: eval.batches <= 2"):
        open_eval_set(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"batches": 3})}), ALONE, data, 1)


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, said",
    [
        (["eval.every=4", "eval.split=0"], "eval.every=4 needs data to evaluate on, but eval.split=0 holds no document out"),
        (["eval.split=0.1", "eval.data=x"], "eval.split=0.1 and eval.data=['x'] both say what to evaluate on; accepted: one"),
        (["eval.split=1"], "config key eval.split = 1 is invalid: expected a value less than 1"),
        (["eval.every=-1"], "config key eval.every = -1 is invalid: expected a value greater than or equal to 0"),
        (["eval.micro_batch=0"], "config key eval.micro_batch = 0 is invalid"),
        (["eval.evry=4"], "unknown config key eval.evry (did you mean eval.every?)"),
    ],
)
def test_bad_eval_values_are_one_line(overrides, said):
    with pytest.raises(UserError, match=re.escape(said)) as err:
        load_config([], overrides)
    assert "\n" not in str(err.value)


@pytest.mark.unit
def test_the_eval_loss_is_the_cross_entropy_alone():
    # A mixture of experts' output is (logits, the routers' auxiliary loss): training's loss
    # adds its gradient (its value stays the cross entropy, what the loss rows show), the
    # evaluation neither.
    spec = LlamaSpec(resolve_shape(load_config([], ["model.preset=tiny-moe"]).model, 64))
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(2, 5, 64, generator=g), torch.randint(0, 64, (2, 5), generator=g)
    aux = torch.tensor(0.25, requires_grad=True)
    ce = F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))
    assert torch.equal(eval_loss(spec)((logits, aux), targets), ce)
    trained = spec.loss((logits, aux), targets)
    assert torch.equal(trained.detach(), ce)
    (grad,) = torch.autograd.grad(trained, [aux])
    assert grad.item() == 1.0  # the auxiliary term's gradient, whole


class _Window(AccumulationWindow):
    """The shared evaluate of the non-pipelined engines, around a model with dropout."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Embedding(50, 16), nn.Dropout(0.5), nn.Linear(16, 50))
        self.device = torch.device("cpu")

    def autocast(self):
        return nullcontext()


@pytest.mark.unit
def test_evaluate_runs_the_model_in_eval_mode_and_sums_over_tokens():
    engine = _Window()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 50, (8, 12), generator=g), torch.randint(0, 50, (8, 12), generator=g)
    ce = lambda out, t: F.cross_entropy(out.reshape(-1, 50), t.reshape(-1))  # noqa: E731
    whole = engine.evaluate([(x, y)], ce)
    split = engine.evaluate([(x[:3], y[:3]), (x[3:], y[3:])], ce)  # uneven micro-batches: the same mean
    assert engine.model.training  # as it was
    with torch.no_grad():
        want = ce(engine.model.eval()(x), y).double()
    assert whole[1].item() == split[1].item() == 96
    torch.testing.assert_close(whole[0] / whole[1], want, rtol=1e-6, atol=0)
    torch.testing.assert_close(split[0] / split[1], want, rtol=1e-6, atol=0)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_scaletrain_eval_of_the_final_checkpoint_gives_the_last_eval_row_at_world_1_and_2(small_dataset, tmp_path):
    run = tmp_path / "run"
    held = ["eval.every=4", "eval.split=0.1", "eval.batches=2", "train.micro_batch=4", "checkpoint.every=8"]
    proc = check(train([*base_overrides(small_dataset, run, steps=8), *held]))
    data = PackedTokens(small_dataset, 64, 1234, held_out=0.1)
    assert data.split.held_documents == 5  # of the corpus's 27 files
    # Training read the stream without them (its samples per epoch say so).
    assert f"data {data.samples_per_epoch:,} samples/epoch" in proc.stdout
    rows = eval_rows(run)
    assert [(r["step"], r["tokens"], r["data"]) for r in rows] == [
        (s, 8 * 64, "eval.split=0.1 (5 of 27 documents)") for s in (4, 8)
    ]
    assert rows[-1]["perplexity"] == pytest.approx(np.exp(rows[-1]["loss"]), rel=1e-12)
    # The checkpoint's own loss on the held-out windows, computed here from its weights.
    windows = torch.from_numpy(Windows(data.documents(held=True), 64).batch(range(8)))
    assert rows[-1]["loss"] == pytest.approx(loss_of(checkpoint_model(run / "checkpoints" / "step_8", 64), windows), rel=1e-5)
    said = re.compile(r"eval .*step_8 \(step 8\): loss ([0-9.]+)  perplexity ([0-9.]+)  .*; (\w+) at world (\d)\)")
    one = check(scaletrain(["eval", str(run)]))
    two = check(scaletrain(["launch", "--nproc", "2", "eval", str(run), "parallel.strategy=fsdp"]))
    for proc, engine, world in ((one, "ddp", "1"), (two, "fsdp", "2")):
        lines = proc.stdout.strip().splitlines()
        match = said.fullmatch(lines[-1])
        assert match and match.group(3, 4) == (engine, world), proc.stdout
        # Printed to 6 decimals: 1e-6 of a loss of ~5.
        assert float(match.group(1)) == pytest.approx(rows[-1]["loss"], rel=1e-5, abs=1e-6)
    # A larger split would evaluate on documents the run trained on.
    with pytest.raises(
        UserError, match=r"eval.split=0.5: .*step_8 was trained with eval.split=0.1, .* accepted: eval.split <= 0.1"
    ):
        checkpoint_config(run / "checkpoints" / "step_8", ["eval.split=0.5"])


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_run_without_a_held_out_split_is_evaluated_on_its_own_documents_when_asked(small_dataset, tmp_path):
    """issue 60: `scaletrain eval` on a run trained without eval.split says in one line how to
    get an evaluation; eval.data=train evaluates on the run's own (trained-on) documents, and
    says so: the same number as eval.data naming its prepared directory."""
    from helpers.launch import one_line_error

    run = tmp_path / "run"
    check(train([*base_overrides(small_dataset, run, steps=2), "train.micro_batch=2"]))
    one_line_error(scaletrain(["eval", str(run)]), "nothing to evaluate on", "eval.data=train", "eval.every > 0 holds 1%")
    own = check(scaletrain(["eval", str(run), "eval.data=train", "eval.batches=1"])).stdout
    named = check(scaletrain(["eval", str(run), f"eval.data={small_dataset}", "eval.batches=1"])).stdout
    assert "the run's own training documents, which it trained on: not a held-out loss" in own
    loss = lambda out: out.split("): loss ", 1)[1].split()[0]  # noqa: E731
    assert loss(own) == loss(named)
    # Evaluating from here on would hold out documents this run trained on: refused, and
    # eval.split=0 is not offered (it leaves nothing to evaluate on).
    resumed = train([*base_overrides(small_dataset, run, steps=4), "train.micro_batch=2", "eval.every=2"])
    said = one_line_error(resumed, "eval.every=2 holds 1% of the documents out by default", "trained on all of them")
    assert "accepted: eval.data=PATHS (evaluate on other text), or a new run.dir" in said


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_resume_that_sets_no_split_keeps_the_held_out_documents_out(small_dataset, tmp_path):
    """issue 60: `make demo` (eval.every=100, so 1% held out) and then the README's `scaletrain
    train` (no evaluation, so no split by eval.split's rule) refused to resume over a split
    nobody set. A resume without eval.split keeps the checkpoint's: the same stream as a run
    that held those documents out from the start, bit for bit."""
    held = ["eval.split=0.1", "train.micro_batch=2"]
    run, straight = tmp_path / "run", tmp_path / "straight"
    # Stopped at step 4 of a 6-step schedule (train.stop_at): the resume's steps take the same rates.
    check(train([*base_overrides(small_dataset, run, steps=6), *held, "train.stop_at=4", "eval.every=4", "eval.batches=1"]))
    proc = check(train([*base_overrides(small_dataset, run, steps=6), "train.micro_batch=2"]))
    assert "eval.split=0.1 as step_4 was trained: the documents it held out stay out (eval.every=0)" in proc.stdout
    assert load_config([str(run / "config.yaml")]).eval.split == 0.1
    check(train([*base_overrides(small_dataset, straight, steps=6), *held]))
    losses = lambda r: [x["loss"] for x in read_metrics(r / "metrics.jsonl")]  # noqa: E731
    assert losses(run) == losses(straight) and len(losses(run)) == 6
