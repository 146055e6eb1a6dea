"""The planner's long sequences (planning/context.py, planning/memory.py, planning/longest.py):
Ulysses keeps no other rank's keys and values and its traffic per rank shrinks with cp;
tiles take the feed-forward's hidden activations and the whole logits out of the peak;
activation offload moves what the blocks keep to the host on a GPU and nothing on a CPU;
`plan --longest-sequence` answers the issue's question for 8B on one node of 8 x 80 GiB.
(`plan --measure` with tiles against measured peaks: test_plan_measure.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from scaletrain.cli import main
from scaletrain.config import load_config
from scaletrain.config.parallel import dims_for
from scaletrain.models import model_spec
from scaletrain.models.spec import with_fields
from scaletrain.planning import planning_spec
from scaletrain.planning.context import cp_comm_bytes_per_step
from scaletrain.planning.hardware import gpu, this_cpu
from scaletrain.planning.longest import GRANULE, LOSS_CHUNK, MAX_TOKENS, longest_sequences
from scaletrain.planning.memory import estimate, ffn_hidden_bytes
from scaletrain.planning.planner import evaluate
from scaletrain.planning.setup import Setup

pytestmark = pytest.mark.unit

SEQ = 65536


@pytest.fixture(scope="module")
def eight_b():
    cfg = load_config([], ["model.preset=8b", f"data.seq_len={SEQ}", "precision=bf16", "parallel.strategy=fsdp"])
    base = replace(Setup.from_config(cfg, dims_for(cfg.parallel, 8)), micro_batch=1, grad_accum=1, activation_checkpointing=False)
    return cfg, model_spec(cfg, None), base


def test_ulysses_holds_no_other_ranks_keys_and_its_traffic_shrinks_with_cp(eight_b):
    _, model, base = eight_b
    gather = {cp: replace(base, cp=cp, dp=8 // cp) for cp in (2, 8)}
    ulysses = {cp: replace(s, cp_mode="ulysses") for cp, s in gather.items()}
    for cp in (2, 8):
        # The same local tokens; the all-gather design also keeps (cp-1)/cp of every block's K and V.
        kv = 2 * SEQ * (cp - 1) / cp * 8 * 128 * 2 * model.n_blocks
        assert estimate(model, gather[cp]).activations - estimate(model, ulysses[cp]).activations == pytest.approx(kv)
    # Per rank: the gathers move (cp-1)/cp of the whole sequence's K, V (about constant in cp);
    # Ulysses' all-to-alls (cp-1)/cp of its own T/cp positions' q, k, v, out (about 1/cp).
    g2, g8 = (cp_comm_bytes_per_step(model, gather[c]) for c in (2, 8))
    u2, u8 = (cp_comm_bytes_per_step(model, ulysses[c]) for c in (2, 8))
    assert g8 / g2 == pytest.approx(7 / 4) and u8 / u2 == pytest.approx((7 / 8 / 8) / (1 / 2 / 2))
    assert u8 < g8
    # Under tp 2 each rank exchanges its own 16 of the 32 heads (4 of the 8 kv heads): half the bytes.
    with_tp = replace(ulysses[2], tp=2, dp=2)
    assert cp_comm_bytes_per_step(model, with_tp) == pytest.approx(u2 / 2)


def test_tiles_take_the_hidden_activations_and_the_whole_logits_out(eight_b):
    _, model, base = eight_b
    plain, tiled = estimate(model, base), estimate(model, replace(base, tile_tokens=8192))
    blocks = model.n_blocks
    saved = plain.activations - tiled.activations
    # Written out from the 8b's shape, not from the planner's own helper: each of its 32 blocks
    # keeps four tensors of 65536 positions x 14336 (the feed-forward's width), 2 bytes each,
    # which a tile recomputes instead: 32 x 4 x 65536 x 14336 x 2 = 224 GiB.
    assert (blocks, model.shape.ffn_dim) == (32, 14336)
    assert saved == 32 * 4 * 65536 * 14336 * 2 == 240_518_168_576
    assert saved == pytest.approx(blocks * ffn_hidden_bytes(model, base, SEQ))
    assert tiled.loss < plain.loss / 4  # one tile's logits and their fp32 work, not 65536 positions'


def test_activation_offload_moves_what_the_blocks_keep_on_a_gpu_and_nothing_on_a_cpu(eight_b):
    cfg, model, base = eight_b
    checkpointed = replace(base, activation_checkpointing=True)
    offloaded = replace(checkpointed, activation_offload=True)
    h100 = gpu("h100", "80GiB")
    on_gpu = [evaluate(model, s, cfg, h100, 1, h100.memory, None) for s in (checkpointed, offloaded)]
    kept = on_gpu[0].memory.activations / model.n_blocks  # each block's input
    assert on_gpu[1].memory.activations == pytest.approx(kept)  # the block in flight
    assert on_gpu[1].memory.cpu == pytest.approx(on_gpu[0].memory.activations - kept)
    # The copies out hide behind the forward, the prefetched copies back behind the backward;
    # over a link a thousand times slower they no longer do.
    assert on_gpu[1].step_time == on_gpu[0].step_time
    slow = replace(h100, host_bw=h100.host_bw / 1000)
    over_slow = [evaluate(model, s, cfg, slow, 1, slow.memory, None) for s in (checkpointed, offloaded)]
    assert over_slow[1].step_time > over_slow[0].step_time
    cpu = this_cpu(2**40)
    # Memory only: untimed, the clock does not replay the 8b's operations on this CPU (~40 s).
    on_cpu = [evaluate(model, s, cfg, cpu, 1, cpu.memory, None, timed=False) for s in (checkpointed, offloaded)]
    assert on_cpu[1].memory == on_cpu[0].memory  # a CPU's host is its device


def test_the_longest_sequence_for_8b_on_one_node_is_past_alsts_3_7_million(capsys):
    args = ["plan", "model.preset=8b", "precision=bf16", "--gpus-per-node", "8", "--gpu-memory", "80GiB"]
    assert main([*args, "--longest-sequence", "--json"]) == 0
    rows = {r["layout"]: r for r in json.loads(capsys.readouterr().out)["longest"]}
    best = max(rows.values(), key=lambda r: r["seq_len"])
    assert best["seq_len"] >= 3_700_000 and "cp 8" in best["layout"] and "activations->cpu" in best["layout"]
    # The answer, in every layout: its length fits and one more step of the search's granule does not.
    cfg = load_config([], ["model.preset=8b", "precision=bf16"])
    h100, model = gpu(None, "80GiB"), planning_spec(cfg)
    chunked = with_fields(model, loss_chunk_tokens=LOSS_CHUNK)  # as the search takes a 128k vocabulary
    for row in longest_sequences(cfg, model, 8, 1, h100, h100.memory * 0.9, None):
        s = row.candidate.setup
        step = GRANULE * (2 * s.cp if s.cp_mode == "allgather" and s.cp > 1 else s.cp)
        fits = [
            evaluate(chunked, replace(s, seq_len=n), cfg, h100, 1, h100.memory * 0.9, None).fits
            for n in (row.seq_len, row.seq_len + step)
        ]
        assert fits == [True, False], (row.layout, row.seq_len)
    assert best["peak"] <= 0.9 * 80 * 2**30 and best["cpu"] > 0 and best["step_time_s"] > 0
    # Each of tiles, offload and cp lengthens what fits; Ulysses (no gathered keys) beyond the all-gather.
    plain, tiles = rows["fsdp + AC"]["seq_len"], rows["fsdp + tiles 8192 + AC"]["seq_len"]
    assert 0 < plain < tiles < rows["fsdp + tiles 8192 + activations->cpu + AC"]["seq_len"]
    gather = rows["fsdp + cp 8 + tiles 8192 + activations->cpu + AC"]["seq_len"]
    assert gather < rows["fsdp + cp 8 (ulysses) + tiles 8192 + activations->cpu + AC"]["seq_len"]
    assert main([*args, "--longest-sequence"]) == 0
    table = capsys.readouterr().out
    assert "longest: " in table and "peak at" in table and "block recompute" in table


def test_the_longest_sequence_of_a_mixture_of_experts_weighs_expert_parallel_and_tiles(capsys):
    # Qwen3-MoE-30B-A3B (128 experts) on one node of 8: each layout also at ep 8 (under cp 8
    # too: the ep group takes the cp ranks in), where FSDP gathers 16 of a block's 128
    # experts instead of all, so the buffers shrink and a longer sequence fits; tiles cut the
    # experts' slots and hidden activations as they do a dense feed-forward's.
    args = ["plan", "model.preset=qwen3-moe-30b-a3b", "precision=bf16", "--gpus-per-node", "8", "--gpu-memory", "80GiB"]
    assert main([*args, "--longest-sequence", "--json"]) == 0
    rows = {r["layout"]: r for r in json.loads(capsys.readouterr().out)["longest"]}
    plain, ep = rows["fsdp + AC"], rows["fsdp + ep 8 + AC"]
    assert ep["buffers"] < plain["buffers"] / 2 and plain["seq_len"] < ep["seq_len"]
    assert ep["seq_len"] < rows["fsdp + ep 8 + tiles 8192 + AC"]["seq_len"]
    for design in ("cp 8", "cp 8 (ulysses)"):
        assert rows[f"fsdp + ep 8 + {design} + AC"]["seq_len"] > 4 * ep["seq_len"]
        assert f"fsdp + {design} + AC" not in rows  # at the largest ep only
    # A capacity factor counts a micro-batch's whole slots: neither cp nor tiles run with it;
    # activation offload does, alone.
    assert main([*args, "model.moe.capacity_factor=1.25", "--longest-sequence", "--json"]) == 0
    capped = {r["layout"]: r["seq_len"] for r in json.loads(capsys.readouterr().out)["longest"]}
    assert list(capped) == [
        "fsdp + AC",
        "fsdp + activations->cpu + AC",
        "fsdp + ep 8 + AC",
        "fsdp + ep 8 + activations->cpu + AC",
    ]
    assert capped["fsdp + AC"] < capped["fsdp + activations->cpu + AC"]


def test_the_longest_sequence_says_when_no_layout_fits_and_why(capsys):
    # Mixtral-8x7B's states alone, sharded over 8 devices, pass 72 GiB at the optimizer step.
    args = ["plan", "model.preset=mixtral-8x7b", "precision=bf16", "--gpus-per-node", "8", "--gpu-memory", "80GiB"]
    assert main([*args, "--longest-sequence"]) == 0
    said = capsys.readouterr().out
    assert "none fits even 1,024 tokens: the lowest peak, fsdp + ep 8 + AC's, is" in said
    assert "at the optimizer step" in said and "longest: 0" not in said


# An HF Llama with 12 heads (4 kv heads): on 8 devices Ulysses runs at cp 2 and 4, not 8.
HF_12_HEADS = {"model_type": "llama", "hidden_size": 768, "num_hidden_layers": 4, "num_attention_heads": 12,
               "num_key_value_heads": 4, "intermediate_size": 2048, "vocab_size": 32000,
               "max_position_embeddings": 262144}  # fmt: skip


def test_the_longest_sequence_of_a_hugging_face_model_is_ulysses_at_the_sizes_it_takes_and_its_positions(capsys):
    # Ulysses at cp 4 (12 heads do not split over 8), no all-gather design and no tiles (both
    # the built-in model's), and no row longer than its max_position_embeddings, which
    # `train` would refuse.
    args = ["plan", "model.source=hf", f"model.hf_config={json.dumps(HF_12_HEADS)}", "precision=bf16", "--gpus-per-node", "8"]
    assert main([*args, "--gpu-memory", "80GiB", "--longest-sequence", "--json"]) == 0
    rows = {r["layout"]: r for r in json.loads(capsys.readouterr().out)["longest"]}
    assert list(rows) == ["fsdp + AC", "fsdp + activations->cpu + AC", "fsdp + cp 4 (ulysses) + AC",
                          "fsdp + cp 4 (ulysses) + activations->cpu + AC"]  # fmt: skip
    plain, ulysses = rows["fsdp + AC"], rows["fsdp + cp 4 (ulysses) + AC"]
    assert plain["capped"] == "" and 0 < plain["seq_len"] < 262144 and plain["peak"] > 0.95 * 0.9 * 80 * 2**30
    assert ulysses["capped"] == "positions" and ulysses["seq_len"] == 262144 and ulysses["peak"] < 0.9 * 80 * 2**30
    assert main([*args, "--gpu-memory", "80GiB", "--longest-sequence"]) == 0
    said = capsys.readouterr().out
    assert "262,144 (max)" in said and "the model's max_position_embeddings (262,144) stops it, not memory" in said


def test_auto_plans_ulysses_for_a_hugging_face_model_whose_sequence_fits_no_rank_whole(capsys):
    # 262,144 tokens a sequence: no layout holds one on a rank (cp 1 reaches ~130k above);
    # Ulysses at cp 2 does (131,072 tokens a rank), and cp 8 and the all-gather design are never
    # candidates.
    args = ["plan", "model.source=hf", f"model.hf_config={json.dumps(HF_12_HEADS)}", "precision=bf16",
            "data.seq_len=262144", "train.global_batch=8", "train.micro_batch=1", "--gpus-per-node", "8",
            "--gpu-memory", "80GiB", "--json"]  # fmt: skip
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    # Without activation checkpointing since the HF block is traced in bf16 as the engine runs it
    # (in fp32 until 2026-11-29, twice its activations: "+ AC" was needed then); at cp 2 since its
    # attention is traced causal, as the run's (until 2026-11-30 transformers took the fake position
    # ids for packed sequences and built a whole mask: cp 4 was chosen then).
    assert plan["chosen"] == "fsdp + cp 2 (ulysses)"
    with_cp = [c["strategy"] for c in plan["candidates"] if " cp " in c["strategy"]]
    assert with_cp and all("(ulysses)" in c and "cp 8" not in c for c in with_cp), with_cp
    assert not [c for c in plan["candidates"] if c["fits"] and " cp " not in c["strategy"]]


def test_a_row_the_search_ends_says_so(capsys):
    # The tiny preset under cp 8 with tiles holds more than the search's 33.5M tokens: its
    # rows stop at MAX_TOKENS, marked, and the summary says memory would hold more.
    args = ["plan", "model.preset=tiny", "--gpus-per-node", "8", "--longest-sequence"]
    assert main([*args, "--json"]) == 0
    rows = {r["layout"]: r for r in json.loads(capsys.readouterr().out)["longest"]}
    assert (
        rows["fsdp + cp 8 + tiles 8192 + AC"] | {"capped": "search", "seq_len": MAX_TOKENS}
        == rows["fsdp + cp 8 + tiles 8192 + AC"]
    )
    assert rows["fsdp + AC"]["capped"] == "" and rows["fsdp + AC"]["seq_len"] < MAX_TOKENS
    assert main(args) == 0
    assert f"the search ends at {MAX_TOKENS:,} tokens: memory would hold more" in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_blocks_past_the_traced_length_equal_a_direct_trace(preset):
    """Past BLOCK_TRACE a block's saved bytes are extended from traces at 4k, 8k and 16k
    positions (planning/activations.py): at 32k and 48k they equal a trace at that length,
    byte for byte (dense and a mixture of experts, one and two sequences)."""
    import torch

    from scaletrain.planning.activations import BLOCK_TRACE, _trace_block, block_activations

    model = planning_spec(load_config([], [f"model.preset={preset}"]))
    for seq in (2 * BLOCK_TRACE, 3 * BLOCK_TRACE):
        for micro_batch in (1, 2):
            direct, _ = _trace_block(model, micro_batch, seq, "pure16", torch.bfloat16)
            assert block_activations(model, micro_batch, seq, "pure16").saved == direct, (seq, micro_batch)
