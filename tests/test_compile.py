"""torch.compile per block (train.compile): the compiled run trains as the eager one (fsdp
with activation checkpointing) and keeps the model's parameter names."""

from __future__ import annotations

import pytest

from scaletrain.config import load_config
from scaletrain.errors import UserError

from helpers import assert_same_training, base_overrides, check, train


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
    check(
        train([*base_overrides(small_dataset, run), *options, "checkpoint.every=5", "train.compile=true"], nproc=2, timeout=500)
    )
    # Inductor fuses and reorders fp32 arithmetic (the norms, the SwiGLU, the loss) where
    # eager runs op by op: like another engine's summation order, a few ulps per op, so the
    # engines' own tolerances apply (tests/helpers.py), weights compared by the same names.
    assert_same_training(run, reference_run, evals=False)  # not evaluated: a no-grad forward compiles each block again


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
    with pytest.raises(UserError, match="not with parallel.tp=2, pp=1"):
        load_config([], ["train.compile=true", "parallel.strategy=fsdp", "parallel.tp=2"])
