"""Ulysses context parallel (parallel.cp_mode=ulysses, models/ulysses.py) in runs: fsdp at
cp 2 equals one process (loss and grad norm every step, eval rows, final weights), its
trace holding the four all-to-alls per attention and their backward; zero3 at cp 2 x dp 2
equals it, so does a mixture of experts (balance=bias) with its experts split over the cp
ranks (cp 2 x ep 2; the all-gather design at dp 2 x cp 2 x ep 4 resumed at cp 2 x tp 2 x
ep 2); a cp 2 checkpoint resumes at cp 4 on world 4 (the key/value heads then repeated) as
the straight run; what cannot split is one line. Gradients after one backward (ddp accumulating, fsdp with documents
masked, zero3, MoE with its balance terms) are in test_gradients.py, fine-tuning masks on
zero3 in test_finetune.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from scaletrain.cli import main
from scaletrain.errors import UserError
from scaletrain.models import PRESETS

from helpers.launch import check, train
from helpers.numerics import assert_same_training
from helpers.runs import CP_EVERY, CP_STEPS, base_overrides, cp_overrides, run_info, train_through

ULYSSES = ["parallel.cp_mode=ulysses"]


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
def test_ulysses_cp2_on_fsdp_is_one_process(small_dataset, cp_straight, tmp_path):
    run = tmp_path / "cp2"
    extra = ["train.micro_batch=4", "parallel.strategy=fsdp", "parallel.cp=2", *ULYSSES, "telemetry.profile_steps=[2,2]"]
    check(train(cp_overrides(small_dataset, run, *extra), nproc=2))
    assert run_info(run)["parallel"]["cp"] == 2
    assert_same_training(run, cp_straight, steps=CP_STEPS)
    # q, k, v to heads and the output back: four all-to-alls per attention, four more in
    # its backward (each one's gradient is the inverse exchange); no key/value gathers.
    names = [e.get("name", "") for e in json.loads((run / "profile" / "rank0.trace.json").read_text())["traceEvents"]]
    assert names.count("_c10d_functional::all_to_all_single") == 2 * 4 * PRESETS["tiny"]["n_layers"]
    assert names.count("_c10d_functional::all_gather_into_tensor") == 0


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(400)
def test_ulysses_on_zero3_at_world_4_is_one_process(small_dataset, cp_straight, tmp_path):
    # cp 2 x dp 2: DeepSpeed's data-parallel group is all 4 ranks; ZeRO-3 partitions over
    # them and averages the gradients of the two cp halves of two samples' pairs.
    run = tmp_path / "zero3"
    check(
        train(
            cp_overrides(small_dataset, run, "parallel.strategy=zero3", "parallel.cp=2", *ULYSSES, "train.micro_batch=2"), nproc=4
        )
    )
    assert_same_training(run, cp_straight, steps=CP_STEPS)


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(400)
def test_ulysses_with_tensor_parallel_at_world_4_is_one_process(small_dataset, cp_straight, tmp_path):
    # cp 2 x tp 2: each tp rank's attention holds 2 of the tiny model's 4 heads (1 of its 2
    # key/value heads, repeated twice to split over cp 2); Ulysses' all-to-alls swap those
    # over the cp group, tp's sequence-parallel norms shard each rank's T/cp positions.
    run = tmp_path / "tp2"
    extra = ["parallel.strategy=fsdp", "parallel.cp=2", "parallel.tp=2", *ULYSSES, "train.micro_batch=4"]
    check(train(cp_overrides(small_dataset, run, *extra), nproc=4))
    assert (run_info(run)["parallel"]["cp"], run_info(run)["parallel"]["tp"]) == (2, 2)
    assert_same_training(run, cp_straight, steps=CP_STEPS)


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(400)
def test_ulysses_resumes_at_another_cp_size(small_dataset, cp_straight, tmp_path):
    # Steps 1-4 at cp 2 on world 2, then steps 5-8 at cp 4 on world 4, where the tiny
    # model's 2 key/value heads are each repeated twice to split over 4 ranks (kv_repeat).
    # Ulysses holds no state: the checkpoint is the model's and the optimizer's.
    run = tmp_path / "run"
    layout = ["parallel.strategy=fsdp", "train.micro_batch=4", *ULYSSES]
    links = [
        (cp_overrides(small_dataset, run, *layout, "parallel.cp=2"), 2, "fsdp at world 2 (cp 2)"),
        (cp_overrides(small_dataset, run, *layout, "parallel.cp=4"), 4, "fsdp at world 4 (cp 4)"),
    ]
    train_through(run, links, every=CP_EVERY)
    assert_same_training(run, cp_straight, steps=CP_STEPS)


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(400)
def test_a_mixture_of_experts_under_context_parallel_is_one_process(small_dataset, tmp_path):
    # balance=bias: the load that moves the bias after each step is summed over every rank
    # (each cp rank routes its part of the sequences), beside the sequence-wise term whose
    # counts each rank takes over its cp group (models/moe.py _whole_sequences). With
    # expert parallel the ep group takes the cp ranks in (config/parallel.py): at cp 2 x ep 2
    # it is the cp group (each rank half the experts; with tp 2, each tp coordinate's), at
    # dp 2 x cp 2 x ep 4 all four ranks; the experts' gradients, summed over every rank's
    # tokens, are divided by dp x cp. (Without ep: test_gradients.py's MoE cp variants.)
    moe = ["model.preset=tiny-moe", "model.moe.balance=bias", "parallel.strategy=fsdp", "parallel.cp=2"]
    one, cp2, chain = tmp_path / "one", tmp_path / "cp2-ep2", tmp_path / "chain"
    check(train(cp_overrides(small_dataset, one, *moe[:-1], "train.micro_batch=4")))
    check(train(cp_overrides(small_dataset, cp2, *moe, "parallel.ep=2", *ULYSSES, "train.micro_batch=4"), nproc=2))
    assert_same_training(cp2, one, steps=CP_STEPS)
    # Steps 1-4 with the all-gather design at dp 2 x cp 2 x ep 4, steps 5-8 resumed with
    # Ulysses at cp 2 x tp 2 x ep 2 (the experts' DTensors resharded by DCP), every step as one.
    all_gather = ["parallel.ep=4", "parallel.cp_mode=allgather", "train.micro_batch=2"]
    with_tp = ["parallel.ep=2", "parallel.tp=2", *ULYSSES, "train.micro_batch=4"]
    links = [
        (cp_overrides(small_dataset, chain, *moe, *all_gather), 4, "fsdp at world 4 (cp 2, ep 4)"),
        (cp_overrides(small_dataset, chain, *moe, *with_tp), 4, "fsdp at world 4 (tp 2, cp 2, ep 2)"),
    ]
    train_through(chain, links, every=CP_EVERY)
    assert_same_training(chain, one, steps=CP_STEPS)
    bias = {run: json.loads((run / "checkpoints" / f"step_{CP_STEPS}" / "trainer.json").read_text()) for run in (one, cp2, chain)}
    for run in (cp2, chain):
        # Moved by +-rate per step on the sign of each expert's load: one flipped sign is 2 x 1e-3 apart.
        np.testing.assert_allclose(bias[run]["expert_bias"], bias[one]["expert_bias"], atol=1e-6, err_msg=run.name)
    assert np.abs(bias[one]["expert_bias"]).max() > 0


@pytest.mark.dist
@pytest.mark.equivalence
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_a_hugging_face_sliding_window_under_ulysses_is_one_process(small_dataset, tmp_path, model_type):
    # A window of 16 of the 64 positions: every rank attends over the whole sequence within
    # it (documents.window_mask), as transformers' own sliding-window mask does in one
    # process. Qwen2 with max_window_layers=1: its first layer full, its second windowed
    # (each layer passes its own sliding_window).
    hf = f"model_type: {model_type}, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
    hf += "num_key_value_heads: 2, max_position_embeddings: 64, sliding_window: 16"
    hf += ", use_sliding_window: true, max_window_layers: 1" if model_type == "qwen2" else ""
    common = [o for o in base_overrides(small_dataset, tmp_path, steps=6) if not o.startswith(("model.preset", "run.dir"))]
    common += [
        "model.source=hf",
        f"model.hf_config={{{hf}}}",
        "train.micro_batch=4",
        "parallel.strategy=fsdp",
        "train.log_every=1",
    ]
    one, cp2 = tmp_path / "one", tmp_path / "cp2"
    check(train([*common, f"run.dir={one}"]))
    check(train([*common, f"run.dir={cp2}", "parallel.cp=2", *ULYSSES], nproc=2))
    assert_same_training(cp2, one, steps=6, evals=False)


@pytest.mark.e2e
def test_what_ulysses_cannot_split_is_one_line(small_dataset, tmp_path, capsys):
    base = ["train", f"run.dir={tmp_path / 'run'}", f"data.paths={small_dataset}", "run.device=cpu", "parallel.cp=2"]
    base += [*ULYSSES, "parallel.strategy=fsdp"]
    cases = {
        ("data.seq_len=99",): "cuts each sequence into cp equal runs; data.seq_len=99 does not divide; accepted: data.seq_len a multiple of 2",
        ("parallel.pp=2", "train.grad_accum=2"): "parallel.cp=2 does not combine with parallel.pp=2",
        ("parallel.cp_mode=ring",): "parallel.cp_mode",
    }  # fmt: skip
    for args, says in cases.items():
        assert main([*base, *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("scaletrain: error:") and says in err[0], err


@pytest.mark.unit
def test_heads_that_do_not_split_are_refused_with_the_sizes_that_do():
    from scaletrain.config import load_config
    from scaletrain.models import model_spec
    from scaletrain.models.ulysses import Ulysses, heads_problem, kv_repeat

    # 4 query heads, 2 key/value heads (tiny): cp 2 splits both, cp 4 repeats each kv head twice.
    assert (kv_repeat(2, 2), kv_repeat(2, 4), kv_repeat(8, 4), kv_repeat(6, 4)) == (1, 2, 1, 2)
    assert heads_problem(4, 2, 2) is None and heads_problem(4, 2, 4) is None
    assert "do not divide over cp=3" in str(heads_problem(4, 2, 3))
    # Repeated key/value heads keep the groups: 6 kv heads of 12 at cp 4 become 12, 2 of 8 at cp 8 become 8.
    assert heads_problem(12, 6, 4) is None and heads_problem(8, 2, 8) is None
    cfg = load_config([], ["model.preset=tiny", "data.seq_len=64", "model.vocab_size=512"])
    spec = model_spec(cfg, None)
    with pytest.raises(UserError, match=r"parallel.cp=3 with cp_mode=ulysses splits the heads.*accepted: parallel.cp=1, 2, 4"):
        spec.apply_cp(None, Ulysses(None, 0, 3))
    # Under tp each rank holds n_heads / tp heads: those are what cp splits (tiny at tp 2: 2 heads, 1 kv head).
    assert heads_problem(4, 2, 2, tp=2) is None and heads_problem(8, 4, 4, tp=2) is None
    assert "each tp rank's 2 of the 4 attention heads do not divide over cp=4" in str(heads_problem(4, 2, 4, tp=2))
    with pytest.raises(
        UserError, match=r"parallel.cp=4 with cp_mode=ulysses splits the heads: each tp rank's 2.*accepted: parallel.cp=1, 2,"
    ):
        spec.apply_cp(None, Ulysses(None, 0, 4, tp=2))


@pytest.mark.unit
def test_what_a_hugging_face_model_cannot_split_is_one_line():
    from scaletrain.config import load_config
    from scaletrain.models import model_spec
    from scaletrain.models.context_parallel import ContextParallel
    from scaletrain.models.ulysses import Ulysses

    def spec(hf: str):
        return model_spec(load_config([], ["model.source=hf", f"model.hf_config={{{hf}}}", "data.seq_len=64"]), 512)

    small = "hidden_size: 64, intermediate_size: 128, num_hidden_layers: 1, vocab_size: 512"
    llama = spec(f"model_type: llama, {small}, num_attention_heads: 4, num_key_value_heads: 2")
    with pytest.raises(UserError, match="with cp_mode=allgather is not offered for Hugging Face models"):
        llama.apply_cp(None, ContextParallel(None, 0, 2))
    with pytest.raises(UserError, match="the 4 attention heads do not divide over cp=8"):
        llama.apply_cp(None, Ulysses(None, 0, 8))
    mistral = f"model_type: mistral, {small}, num_attention_heads: 4, num_key_value_heads: 2, sliding_window: 16"
    spec(mistral).apply_cp(torch.nn.Module(), Ulysses(None, 0, 2))  # a sliding window is split (the test below)
    with pytest.raises(UserError, match="model_type mistral: its attention dropout is not applied in a sliding window"):
        spec(f"{mistral}, attention_dropout: 0.1").apply_cp(None, Ulysses(None, 0, 2))
