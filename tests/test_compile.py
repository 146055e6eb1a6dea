"""torch.compile per block (train.compile): the compiled run trains as the eager one (fsdp
with activation checkpointing) and keeps the model's parameter names."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.engines.compile_stats import compile_counters
from scaletrain.errors import UserError
from scaletrain.telemetry import read_metrics

from helpers.launch import check, train
from helpers.numerics import assert_same_training
from helpers.runs import base_overrides


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_compiled_fsdp_run_with_activation_checkpointing_trains_as_the_eager_one(small_dataset, reference_run, tmp_path):
    # fsdp with activation checkpointing at world 2: the compiled block is the checkpoint
    # wrapper, inside FSDP's unit. DDP compiles through the same compile_blocks (checked
    # by hand, docs/engines.md: ~30 s more of compiling here, for one line of call site).
    run = tmp_path / "compiled"
    options = ["train.micro_batch=2", "parallel.strategy=fsdp", "parallel.activation_checkpointing=true"]
    # The chunked loss too, compiled with the blocks (models/loss.py): 2 x 64 positions a micro-batch, two full
    # chunks of 64, each one inductor kernel forward and one backward; equal to the reference's plain loss within
    # the same tolerances (tests/test_loss.py: a few ulps).
    options += ["train.loss_chunk_tokens=64"]
    check(
        train([*base_overrides(small_dataset, run), *options, "checkpoint.every=5", "train.compile=true"], nproc=2, timeout=500)
    )
    # Inductor fuses and reorders fp32 arithmetic (the norms, the SwiGLU, the loss) where
    # eager runs op by op: like another engine's summation order, a few ulps per op, so the
    # engines' own tolerances apply (tests/helpers/numerics.py), weights compared by the same names.
    assert_same_training(run, reference_run, evals=False)  # not evaluated: a no-grad forward compiles each block again
    # What a user sees of it (each interval row's "compile"): no break, and nothing compiled
    # after the first interval (the first step compiles forward and recompute).
    seen = [r["compile"] for r in read_metrics(run / "metrics.jsonl", events=True) if r.get("event") == "interval"]
    assert len(seen) == 2 and seen[1] == seen[0] and seen[0]["graph_breaks"] == 0, seen
    # Three graphs: the block's (every block runs one code object; checked, 1 without the chunked loss) and
    # the loss chunk's forward and backward.
    assert seen[0]["graphs"] == 3, seen


@pytest.mark.unit
def test_every_block_is_compiled_in_place_under_its_own_name():
    # What keeps the equivalence test above from passing by construction: compile_blocks
    # really compiles each block (a no-op would train exactly as eager), in place.
    from scaletrain.engines.block_wrappers import apply_activation_checkpointing, compile_blocks
    from scaletrain.models import model_spec

    spec = model_spec(load_config([], ["model.vocab_size=64"]), None)
    model = spec.build_meta(16)
    names = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(spec.blocks(model))
    compile_blocks(spec.blocks(model))
    blocks = list(spec.blocks(model).children())
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    assert [n.replace("._checkpoint_wrapped_module", "") for n, _ in model.named_parameters()] == names


@pytest.mark.unit
def test_compile_is_refused_where_it_is_not_checked():
    with pytest.raises(UserError, match="train.compile=true is offered with ddp and fsdp"):
        load_config([], ["train.compile=true", "parallel.strategy=zero3"])
    # Pipelines compile with the schedules that run each backward whole (tests/test_gradients.py
    # checks their gradients, compiled); the zero-bubble ones split it, which a compiled block cannot.
    pp = ["train.compile=true", "parallel.strategy=fsdp", "parallel.pp=2", "train.grad_accum=4"]
    assert load_config([], [*pp, "parallel.pp_schedule=interleaved_1f1b"]).train.compile
    for schedule in ("interleaved_zb", "zbv", "dualpipev"):
        with pytest.raises(UserError, match=f"parallel.pp_schedule={schedule} .* accepted: parallel.pp_schedule=gpipe\\|1f1b"):
            load_config([], [*pp, f"parallel.pp_schedule={schedule}"])
    # Tensor parallel compiles (tests/test_gradients.py checks its gradients, compiled).
    assert load_config([], ["train.compile=true", "parallel.strategy=fsdp", "parallel.tp=2"]).train.compile
    with pytest.raises(UserError, match="model.moe.experts_impl=loop: the loop reads the token counts on the host"):
        load_config([], ["train.compile=true", "model.preset=tiny-moe", "model.moe.experts_impl=loop"])
    # Widths the grouped kernel cannot take: when the engine compiles the blocks, before any step.
    from scaletrain.engines.block_wrappers import compile_blocks
    from scaletrain.models import model_spec

    spec = model_spec(load_config([], ["model.vocab_size=64", "model.preset=tiny-moe", "model.moe.expert_ffn_dim=100"]), None)
    with pytest.raises(
        UserError, match=r"model.dim=128 and the expert width 100 \(model.moe.expert_ffn_dim\) must be multiples of 8"
    ):
        compile_blocks(spec.blocks(spec.build_meta(16)))


@pytest.mark.unit
def test_the_compile_counters_count_graphs_breaks_and_recompiles():
    import torch._dynamo

    def f(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    before = compile_counters() or {"graphs": 0, "graph_breaks": 0, "recompiles": 0}
    torch._dynamo.reset()  # clears the compile count per frame, not the counters
    compiled = torch.compile(f, backend="eager", dynamic=False)
    compiled(torch.ones(2))
    compiled(torch.ones(2))  # cached: nothing new
    compiled(torch.ones(3))  # a new static shape: each of the two frames compiles again
    after = compile_counters()
    assert after is not None and after["graph_breaks"] - before["graph_breaks"] == 2, after
    assert after["graphs"] - before["graphs"] == 4 and after["recompiles"] == 2, after


@pytest.mark.e2e  # a unit by its scope; with the runs for its compile time (20-40 s here)
@pytest.mark.equivalence
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_compiled_moe_block_computes_what_the_eager_one_does():
    """Inductor on a mixture-of-experts block (the grouped matmul through
    scaletrain::grouped_mm in fp32, the routing's scatter and sorts, fullgraph): outputs,
    routing counts and every gradient against the same block run eagerly."""
    import copy

    from torch import nn

    from scaletrain.engines.block_wrappers import compile_blocks
    from scaletrain.models import model_spec

    spec = model_spec(load_config([], ["model.vocab_size=64", "model.preset=tiny-moe", "model.n_layers=1"]), None)
    model = spec.build_meta(16)
    spec.materialize(model, torch.device("cpu"), seed=0)
    compiled = nn.ModuleList([copy.deepcopy(model.layers[0])])
    compile_blocks(compiled)
    x, grad = (torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(i)) for i in (0, 1))
    runs = []
    for block in (model.layers[0], compiled[0]):
        inputs = x.clone().requires_grad_()
        y, aux, stats = block(inputs, model.rope_cos, model.rope_sin)
        ((y * grad).sum() + aux).backward()
        runs.append((stats, [y, aux, inputs.grad, *(p.grad for p in block.parameters())]))
    (eager_stats, eager), (compiled_stats, got) = runs
    assert torch.equal(compiled_stats[:8], eager_stats[:8])  # every token went to the same experts
    # Inductor fuses the fp32 elementwise work (norms, softmax, SwiGLU, RoPE) and sums in
    # its own order where eager runs op by op: a few ulps per op over a chain of some tens
    # of them (measured: 5e-7 of each tensor's largest entry at most).
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())


# A dense block then a mixture of experts: both kinds of block compile in one run.
DENSE_AND_MOE = ["model.preset=tiny-moe", "model.n_layers=2", "model.moe.dense_layers=1", "data.seq_len=16"]


class Compiles:
    """What dynamo compiled during each step and evaluation of in-process runs (engines/compile_stats.py)."""

    def __init__(self, monkeypatch):
        import scaletrain.training.evaluation as evaluation
        import scaletrain.training.trainer as trainer

        self.events: list[tuple[str, int, dict[str, int]]] = []  # (what, step, compile counters after it)
        self.start = compile_counters() or {"graphs": 0, "graph_breaks": 0, "recompiles": 0}
        step, evaluate = trainer.train_step, evaluation.evaluate

        def stepping(run):
            step(run)
            self.events.append(("step", run.step, compile_counters()))

        def evaluating(*args, **kwargs):
            row = evaluate(*args, **kwargs)
            self.events.append(("eval", self.events[-1][1], compile_counters()))
            return row

        monkeypatch.setattr(trainer, "train_step", stepping)
        monkeypatch.setattr(evaluation, "evaluate", evaluating)

    def restart(self) -> None:
        self.events.clear()
        self.start = compile_counters() or self.start

    def new_graphs(self) -> list[tuple[str, int, int]]:
        """(what, step, graphs it compiled) for each step and evaluation that compiled one."""
        out, before = [], self.start["graphs"]
        for what, step, counters in self.events:
            if counters["graphs"] > before:
                out.append((what, step, counters["graphs"] - before))
            before = counters["graphs"]
        return out


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_compiled_blocks_compile_each_graph_once_without_a_break(small_dataset, tmp_path, monkeypatch):
    """train.compile on a dense and a mixture-of-experts block (fullgraph=True: a graph
    break would be an error): training compiles each kind of block once in the first step
    and never again, through accumulation, evaluations, an out-of-memory restart at half
    the micro-batch, and a resume. What does compile again, from dynamo's own counters:
    an evaluation's no-grad forward, once per kind of block and micro-batch shape (here 3
    and the shorter last 1 of each 4-sequence eval batch), and the micro-batch an
    out-of-memory error halves (one training graph per kind at the new shape); a resumed
    process compiles anew, once."""
    import torch._dynamo

    import scaletrain.engines.block_wrappers as block_wrappers
    import scaletrain.training.trainer as trainer
    from scaletrain.resilience import faults

    # Dynamo's decisions (graphs, breaks, guards) do not depend on the backend; aot_eager
    # traces forward and backward as inductor would (fake tensors, autograd) without its
    # C++ compilation. The inductor itself: the fsdp run and the MoE block tests in this file.
    monkeypatch.setattr(block_wrappers, "BACKEND", "aot_eager")
    run = tmp_path / "run"
    args = [*base_overrides(small_dataset, run, steps=5), *DENSE_AND_MOE, "train.micro_batch=2", "train.grad_accum=2"]
    args += ["train.compile=true", "checkpoint.every=2", f"eval.data={small_dataset}", "eval.every=2", "eval.batches=2"]
    args += ["eval.micro_batch=3"]  # each rank's 4 eval sequences as 3 + 1
    torch._dynamo.reset()
    compiles = Compiles(monkeypatch)
    before = compiles.start
    # The first forward of step 3 runs out of memory (resilience/faults.py's drill): one process
    # restarts itself from step_2 at micro-batch 1, 4 accumulated (resilience/oom.py).
    monkeypatch.setattr(faults, "_ARMED", ("oom", 3))
    trainer.train(load_config([], args))
    assert [(w, s) for w, s, _ in compiles.events] == [
        ("step", 1), ("step", 2), ("eval", 2), ("step", 3), ("step", 4), ("eval", 4), ("step", 5), ("eval", 5)
    ]  # fmt: skip
    assert compiles.new_graphs() == [("step", 1, 2), ("eval", 2, 4), ("step", 3, 2)], compiles.events
    after = compile_counters()
    assert after is not None and after["graph_breaks"] == before["graph_breaks"], after
    # Every compiled block runs one code object (nn.Module._call_impl): its first graph is
    # a compile, each later one (another kind, shape or grad mode) a recompile.
    assert after["recompiles"] - before["recompiles"] == 7, after

    # A resume is a new process: dynamo starts empty (its caches reset as at a start).
    torch._dynamo.reset()
    compiles.restart()
    trainer.train(load_config([], [*args, "train.steps=7"]))
    assert [(w, s) for w, s, _ in compiles.events] == [("step", 6), ("eval", 6), ("step", 7), ("eval", 7)]
    assert compiles.new_graphs() == [("step", 6, 2), ("eval", 6, 4)], compiles.events
    assert compiles.events[-1][2]["graph_breaks"] == before["graph_breaks"] and compiles.events[-1][2]["recompiles"] == 5
