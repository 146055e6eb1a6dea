"""train.optimizer=muon (optim/muon.py): torch's Muon for the blocks' matrices, AdamW for
the embedding, head and gains, as one optimizer: which parameters each steps, that the
composite steps as the two torch optimizers would and keeps doing so after a load, ddp at
world 2 equal to one process, a resume bit for bit and from world 2 onto world 1, and the
one-line refusals."""

from __future__ import annotations

import copy
from dataclasses import replace
from functools import partial

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.config.parallel import dims_for
from scaletrain.errors import UserError
from scaletrain.models import model_spec
from scaletrain.models.params import canonical_name
from scaletrain.optim.muon import MUON_MOMENTUM
from scaletrain.optim.optimizers import build_adamw, build_optimizer, decay_groups
from scaletrain.planning.memory import estimate
from scaletrain.planning.planner import comm_bytes_per_step, setups_for
from scaletrain.planning.setup import Setup

from helpers.launch import check, one_line_error, train
from helpers.numerics import assert_bit_exact, assert_same_training
from helpers.runs import base_overrides, copy_until, eval_overrides

MUON = ["train.optimizer=muon"]


def _model_and_groups(*overrides: str):
    cfg = load_config([], [*([] if "model.source=hf" in overrides else ["model.vocab_size=64"]), *MUON, *overrides])
    torch.manual_seed(0)
    model = model_spec(cfg, 64).build_meta(16)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.tie_weights()  # to_empty unties them (the built-in model's and transformers' method alike)
    return cfg, model, decay_groups(cfg.train)(model)


GPT2 = "{model_type: gpt2, n_embd: 32, n_layer: 2, n_head: 2, n_positions: 32, vocab_size: 64}"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "blocks", "on_adamw"),
    [
        ([], "layers.", {"tok_embeddings.weight"}),
        # GPT-2: its position table is 2-D too, and its blocks' matrices are Conv1D weights.
        (["model.source=hf", f"model.hf_config={GPT2}"], "transformer.h.", {"transformer.wte.weight", "transformer.wpe.weight"}),
    ],
    ids=["builtin", "hf-gpt2"],
)
def test_muon_steps_the_blocks_matrices_and_adamw_the_embeddings_head_and_gains(overrides, blocks, on_adamw):
    _, model, groups = _model_and_groups(*overrides)
    names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in groups if g.get("muon") for p in g["params"]}
    adamw = {names[id(p)] for g in groups if not g.get("muon") for p in g["params"]}
    assert muon == {canonical_name(n) for n, p in model.named_parameters() if p.ndim == 2 and n.startswith(blocks)}
    assert on_adamw <= adamw and all(p.ndim == 1 for n, p in model.named_parameters() if names[id(p)] in adamw - on_adamw)
    assert all(g["weight_decay"] == 0.1 for g in groups if g.get("muon"))  # the matrices' decay


@pytest.mark.unit
@pytest.mark.parametrize("overrides", [[], ["model.source=hf", f"model.hf_config={GPT2}"]], ids=["builtin", "hf-gpt2"])
def test_the_plan_counts_one_buffer_for_what_muon_steps_and_only_where_it_runs(overrides):
    cfg, model, groups = _model_and_groups(*overrides)
    spec = model_spec(cfg, 64)
    stepped = sum(p.numel() for g in groups if g.get("muon") for p in g["params"])  # the optimizer's own split
    assert spec.counts().muon == stepped > 0
    setup = Setup.from_config(cfg, dims_for(cfg.parallel, 1))
    assert setup.optimizer == "muon"
    # Muon's momentum (fp32) in place of AdamW's two fp32 moments, for those elements only.
    assert estimate(spec, replace(setup, optimizer="adamw")).optimizer - estimate(spec, setup).optimizer == 4 * stepped
    planned = setups_for(cfg, 4, 1, True, spec)
    assert {s.strategy for s in planned} == {"ddp", "fsdp"}  # optim/registry.py: not DeepSpeed's
    assert all(s.pp == s.cp == s.dp_replicate == 1 and s.offload_params == "none" for s in planned)
    # tp where the model splits (tiny: 2 kv heads; Hugging Face's GPT-2 has no tp plan here).
    assert {s.tp for s in planned} == ({1, 2} if not overrides else {1})
    # fsdp gathers each matrix's fp32 update once per step: (n-1)/n of 4 bytes per element at world n,
    # its tp ranks' slices too (n = dp x tp).
    for dp, tp in ((4, 1), (2, 2)):
        fsdp = replace(setup, strategy="fsdp", dp=dp, tp=tp, sequence_parallel=tp > 1)
        extra = comm_bytes_per_step(spec, fsdp, 1) - comm_bytes_per_step(spec, replace(fsdp, optimizer="adamw"), 1)
        assert extra == pytest.approx(3 / 4 * 4 * stepped, rel=1e-12)


def _steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()


@pytest.mark.unit
def test_the_composite_steps_as_torchs_two_optimizers_and_goes_on_so_after_a_load():
    cfg, model, groups = _model_and_groups()
    params = [p for g in groups for p in g["params"]]
    grads = [[torch.randn_like(p) for p in params] for _ in range(4)]
    # The reference: torch's Muon and AdamW, each over its own groups, on a copy of the model.
    twin = copy.deepcopy(model)
    twin_params = dict(zip(map(id, model.parameters()), twin.parameters()))
    twin_groups = [{**g, "params": [twin_params[id(p)] for p in g["params"]]} for g in groups]
    muon = torch.optim.Muon(
        [g for g in twin_groups if g.get("muon")], lr=cfg.train.lr, momentum=MUON_MOMENTUM, adjust_lr_fn="match_rms_adamw"
    )
    adamw = build_adamw([g for g in twin_groups if not g.get("muon")], cfg.train, torch.device("cpu"))
    composite = build_optimizer(groups, cfg.train, torch.device("cpu"))
    _steps(composite, params, grads[:2])
    twin_list = [twin_params[id(p)] for p in params]
    for step_grads in grads[:2]:
        for p, g in zip(twin_list, step_grads):
            p.grad = g.clone()
        muon.step()
        adamw.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin_list))
    # Saved and loaded into a new composite (as a resume does): the next steps the same.
    again = build_optimizer(groups, cfg.train, torch.device("cpu"))
    again.load_state_dict(copy.deepcopy(composite.state_dict()))
    assert all(opt.state is again.state for opt in again.inner)
    assert [g for opt in again.inner for g in opt.param_groups] == again.param_groups
    for group in again.param_groups:  # the schedule sets each group's lr: both inner optimizers see it
        group["lr"] = 0.5 * cfg.train.lr
    for group in muon.param_groups + adamw.param_groups:
        group["lr"] = 0.5 * cfg.train.lr
    _steps(again, params, grads[2:])
    for step_grads in grads[2:]:
        for p, g in zip(twin_list, step_grads):
            p.grad = g.clone()
        muon.step()
        adamw.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin_list))


@pytest.mark.unit
def test_a_stack_of_experts_steps_as_torchs_muon_steps_each_expert_alone():
    """A mixture of experts' [experts, rows, columns] weights are on Muon, each expert's
    matrix orthogonalised on its own with its own shape's learning rate: bit for bit what
    torch's Muon does with every expert's matrix as a parameter of its own."""
    # Two of tiny-moe's four blocks: torch's Muon orthogonalises 24 expert matrices a step one
    # by one in bf16, slow on a CPU, and a third block would repeat the second's check.
    cfg, model, groups = _model_and_groups("model.preset=tiny-moe", "model.n_layers=2")
    names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
    on_muon = {names[id(p)]: p for g in groups if g.get("muon") for p in g["params"]}
    stacks = {n: p for n, p in on_muon.items() if p.ndim == 3}
    assert sorted(stacks) == sorted(f"layers.{i}.feed_forward.experts.{w}" for i in range(2) for w in ("w1", "w2", "w3"))
    assert "layers.0.feed_forward.router.weight" in on_muon  # a matrix like any other
    composite = build_optimizer(groups, cfg.train, torch.device("cpu"))
    # torch's Muon over each expert's matrix as a parameter (w1 [8, 128, 384]: 8 matrices of 128 x 384).
    twins = {n: [torch.nn.Parameter(m.detach().clone()) for m in p] for n, p in stacks.items()}
    muon = torch.optim.Muon([q for qs in twins.values() for q in qs], lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                            momentum=MUON_MOMENTUM, adjust_lr_fn="match_rms_adamw")  # fmt: skip
    torch.manual_seed(1)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 0.01
        for n, p in stacks.items():
            for q, g in zip(twins[n], p.grad):
                q.grad = g.clone()
        composite.step()
        muon.step()
    for n, p in stacks.items():
        assert all(torch.equal(m, q) for m, q in zip(p, twins[n])), n


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["parallel.strategy=zero2"], "not with parallel.strategy=zero2 (DeepSpeed 0.19.8's own Muon is another step"),
        (["parallel.strategy=fsdp", "parallel.pp=2", "train.grad_accum=2"], "not with parallel.pp=2 (not checked yet)"),
        (["parallel.strategy=fsdp", "parallel.dp_replicate=2"], "not with parallel.dp_replicate=2 (not checked yet)"),
    ],
)
def test_where_muon_is_not_built_is_one_line(overrides, said):
    with pytest.raises(UserError) as err:
        load_config([], [*MUON, *overrides])
    assert said in str(err.value) and "accepted:" in str(err.value) and "\n" not in str(err.value)


STEPS = 8
# Final weights: torch's Muon runs its Newton-Schulz iterations in bf16 (as Keller Jordan's
# reference does), so momenta that differ by summation order (~1e-7) round some elements of
# each step's update one bf16 ulp apart, 2^-8 of the update; over STEPS updates, each smaller
# than the weight it moves, a weight differs by at most STEPS x 2^-8 of itself. (Measured at
# world 2 after 8 steps: 8e-3 in the attention output projections.) Losses and grad norms keep
# the standing tolerances.
MUON_WEIGHTS_RTOL = STEPS * 2**-8


# What AdamW steps beside Muon (embeddings, head, norm gains) differs only through the gradients
# the Muon-stepped blocks above pass down: measured <= 2.4e-4 after 8 steps (ddp, fsdp,
# fsdp-tp2, the experts cut inside; avx512 kernels), just over the standing WEIGHTS_RTOL. A
# weight decay missing or doubled in one layout moves them by sum(lr) x 0.1 = 1.65e-3 (lr 3e-3,
# warmup 2, cosine over 8). Allowed 8e-4: 3x the measured, half the decay's. A mixture of
# experts' routing turns those differences into other experts chosen for some tokens (its
# embeddings measured 1.7e-3 apart): held to the Muon bound, as its matrices.
MUON_ADAMW_RTOL = 8e-4


def muon_weights_rtol(name: str, tensor: torch.Tensor, moe: bool = False) -> float:
    """The bound above for what Muon steps (the blocks' matrices, stacked experts included),
    MUON_ADAMW_RTOL for what AdamW steps beside it (a mixture of experts': the Muon bound)."""
    muon = name.startswith("layers.") and tensor.dim() >= 2
    return MUON_WEIGHTS_RTOL if muon or moe else MUON_ADAMW_RTOL


# Losses (training and evaluation) feel those roundings too, from step 2 on: where AdamW's
# updates differ by fp32 roundings (~6e-8, the standing 1e-5), Muon's differ by bf16 ones in a
# random-signed fraction of their elements, far below 2^-8 of a step's loss decrease (0.3
# here: 1.2e-3) but above the standing tolerance. Measured at world 2 and after the N -> M
# resume, ddp and fsdp: <= 1.1e-5 on avx512 kernels, 4.2e-6 on avx2, 9.6e-6 on the portable
# ones. Allowed 1e-4; the shard-orthogonalising plant (docs/testing.md) moves the eval loss
# by 4.9e-3, 49 x that.
MUON_LOSS_RTOL = 1e-4


def _one_process(small_dataset, run, *model: str):
    args = [*base_overrides(small_dataset, run, steps=STEPS), *MUON, *model, "train.micro_batch=8", "checkpoint.every=4"]
    check(train([*args, *eval_overrides(small_dataset)]))
    return run


@pytest.fixture(scope="module")
def one_process(small_dataset, tmp_path_factory):
    return _one_process(small_dataset, tmp_path_factory.mktemp("muon") / "w1")


@pytest.fixture(scope="module")
def moe_one_process(small_dataset, tmp_path_factory):
    """tiny-moe on Muon in one process: its stacked experts stepped matrix by matrix."""
    return _one_process(small_dataset, tmp_path_factory.mktemp("muon-moe") / "w1", "model.preset=tiny-moe")


# World 2, 8 sequences a step as one process: 2 ranks x 4, or (tp: one data-parallel rank) 2 x 4 accumulated.
LAYOUTS = {
    "ddp": ["parallel.strategy=ddp"],
    "fsdp": ["parallel.strategy=fsdp"],
    "fsdp-tp2": ["parallel.strategy=fsdp", "parallel.tp=2", "train.grad_accum=2"],
    # tiny-moe: each rank holds 4 of the 8 experts of each layer (the stacks gathered whole for the step).
    "moe-fsdp-ep2": ["model.preset=tiny-moe", "parallel.strategy=fsdp", "parallel.ep=2"],
}


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_world_2_equals_one_process_and_its_checkpoint_resumes_at_world_1(
    one_process, moe_one_process, small_dataset, tmp_path, layout
):
    ref, model = (moe_one_process, ["model.preset=tiny-moe"]) if layout.startswith("moe-") else (one_process, [])
    w2 = tmp_path / "w2"
    args = [*base_overrides(small_dataset, w2, steps=STEPS), *MUON, "train.micro_batch=4", "checkpoint.every=4"]
    check(train([*args, *LAYOUTS[layout], *eval_overrides(small_dataset)], nproc=2))
    # The standing tolerances (helpers/numerics.py) for grad norms, Muon's for losses and weights: the
    # same gradients up to summation order, and Newton-Schulz on each whole matrix (every rank
    # holds them all under ddp; fsdp's ranks gather each matrix's update, tp's and ep's
    # included: optim/muon.py ShardedMuon). The orthogonalised half of a matrix is another
    # matrix: its updates differ from the first step on, far beyond these tolerances.
    rtol = partial(muon_weights_rtol, moe=layout == "moe-fsdp-ep2")
    assert_same_training(w2, ref, steps=STEPS, weights_rtol=rtol, loss_rtol=MUON_LOSS_RTOL)
    # N -> M: world 2's step 4 continued by one process (fsdp: its sharded momenta resharded
    # by DCP), against one process straight through.
    moved = tmp_path / "moved"
    copy_until(w2, moved, 4)
    out = check(train([*base_overrides(small_dataset, moved, steps=STEPS), *MUON, *model, "train.micro_batch=8",
                       "checkpoint.every=4", *eval_overrides(small_dataset)])).stdout  # fmt: skip
    assert "resumed from step_4" in out
    assert_same_training(moved, ref, steps=STEPS, weights_rtol=rtol, loss_rtol=MUON_LOSS_RTOL)


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(400)
def test_experts_fsdp_cuts_inside_are_gathered_whole(small_dataset, tmp_path):
    """2 experts at ep 2 on 4 ranks: each rank holds 1 expert, which FSDP shards over the 2
    ranks holding it along its rows (Shard(1), engines/expert_parallel.py): the stack is
    gathered whole for the step (where at ep 2 on 2 ranks each rank's experts were whole and
    stayed where they were), and the run equals one process."""
    model = ["model.preset=tiny-moe", "model.moe.experts=2"]
    ref = _one_process(small_dataset, tmp_path / "w1", *model)
    run = tmp_path / "w4"
    args = [*base_overrides(small_dataset, run, steps=STEPS), *MUON, *model, "train.micro_batch=2", "checkpoint.every=4"]
    check(train([*args, "parallel.strategy=fsdp", "parallel.ep=2", *eval_overrides(small_dataset)], nproc=4))
    assert_same_training(run, ref, steps=STEPS, weights_rtol=muon_weights_rtol, loss_rtol=MUON_LOSS_RTOL)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_resume_is_bit_exact_and_one_that_changes_the_optimizer_is_refused(one_process, small_dataset, tmp_path):
    resumed = tmp_path / "resumed"
    copy_until(one_process, resumed, 4)
    args = [*base_overrides(small_dataset, resumed, steps=STEPS), "train.micro_batch=8", "checkpoint.every=4"]
    one_line_error(train([*args, *eval_overrides(small_dataset)]), "train.optimizer is 'adamw'", "a fresh start")
    check(train([*args, *MUON, *eval_overrides(small_dataset)]))
    assert_bit_exact(resumed, one_process, STEPS)
