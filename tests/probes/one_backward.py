"""Probe: the full gradients each engine holds after one accumulation window.

Run under torchrun. For each named variant: build the engine exactly as `train` does,
run its `forward_backward` (the trainer's unit of work) on this rank's share of one fixed
global batch (as RankBatches splits it), then assemble the full gradient of every
parameter (a collective) and the mean loss over ranks. Rank 0 saves {variant: {"loss", "grads"}} to OUT/grads.pt;
the test compares it with one plain backward over the whole batch.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from scaletrain.config.parallel import dims_for
from scaletrain.config.stages import SCHEDULES, SPLIT_BACKWARD
from scaletrain.data import RankBatches
from scaletrain.engines import block_wrappers
from scaletrain.engines.block_wrappers import plain_name
from scaletrain.launch.distributed import init_distributed, shutdown

from common import Z3_PARTITION_ALL, build

GLOBAL_BATCH, SEQ, VOCAB = 4, 32, 512
# The compiled variants check how gradients flow through compiled blocks (AOTAutograd: the
# tensor-parallel bug below showed under aot_eager as under inductor), not inductor's kernels,
# whose numerics tests/test_compile.py checks: aot_eager skips its C++ compilation (~20 s a
# variant under each kernel family on a 2-core CPU, which the suite's budget has not).
block_wrappers.BACKEND = "aot_eager"
# The model every variant and the test's reference build (tiny preset, seed 0).
MODEL = ["model.preset=tiny", f"model.vocab_size={VOCAB}", f"data.seq_len={SEQ}", "train.seed=0", "run.device=cpu"]
SELECTIVE = ["parallel.activation_checkpointing=true", "parallel.ac_mode=selective"]
# name -> overrides; every variant covers the global batch of 4 on 2 ranks.
VARIANTS = {
    "ddp": ["parallel.strategy=ddp", "train.micro_batch=2"],
    "ddp_accum": ["parallel.strategy=ddp", "train.micro_batch=1", "train.grad_accum=2"],
    "fsdp": ["parallel.strategy=fsdp", "train.micro_batch=2"],
    "fsdp_shard_grad_op_accum": [
        "parallel.strategy=fsdp",
        "train.micro_batch=1",
        "train.grad_accum=2",
        "parallel.reshard_after_forward=false",
    ],
    "fsdp_hybrid_accum": ["parallel.strategy=fsdp", "train.micro_batch=1", "train.grad_accum=2", "parallel.dp_replicate=2"],
    "zero1_accum": ["parallel.strategy=zero1", "train.micro_batch=1", "train.grad_accum=2"],
    "zero2": ["parallel.strategy=zero2", "train.micro_batch=2"],
    "zero3_accum": ["parallel.strategy=zero3", "train.micro_batch=1", "train.grad_accum=2", Z3_PARTITION_ALL],
    # Selective checkpointing (parallel.ac_mode=selective): the kept outputs read back, the rest
    # recomputed, on fsdp (with tp 2: sequence parallel's reduce-scatters among the kept), and
    # inside ZeRO-3's gathers.
    "fsdp_selective_ac": ["parallel.strategy=fsdp", "train.micro_batch=2", *SELECTIVE],
    "fsdp_tp2_selective_ac": ["parallel.strategy=fsdp", "parallel.tp=2", "train.micro_batch=4", *SELECTIVE],
    "zero3_selective_ac_accum": ["parallel.strategy=zero3", "train.micro_batch=1", "train.grad_accum=2", Z3_PARTITION_ALL,
                                 *SELECTIVE],
}  # fmt: skip
# Tensor parallel with the blocks compiled (aot_eager: above), sequence parallel on (the default) and
# off: the embedding's reduction reaches the first compiled block as an AsyncCollectiveTensor,
# whose gradient torch 2.13's compiled graph dropped (the token embedding's came back zeros,
# untied, or the head's share alone, tied; models/llama_tp.py). Untied, the embedding's
# gradient is its own; the test compares it with the untied reference.
UNTIED = "model.tie_embeddings=false"
COMPILED_TP_VARIANTS = {
    "fsdp_tp2_compiled": ["parallel.strategy=fsdp", "parallel.tp=2", "train.micro_batch=4", "train.compile=true", UNTIED],
    "fsdp_tp2_nosp_compiled_tied": ["parallel.strategy=fsdp", "parallel.tp=2", "parallel.sequence_parallel=false",
                                    "train.micro_batch=4", "train.compile=true"],
}  # fmt: skip
# Pipeline parallel, pp 2 on 2 ranks, every schedule scaletrain offers: the global batch as
# 4 micro-batches of 1 (dualpipev's minimum: 2 stages per rank x 2 ranks). The embedding
# and the head sit on different stages, so these build the model untied (UNTIED), and the
# test compares them with an untied reference.
PIPELINE_VARIANTS = {
    f"pp2_{schedule}": ["parallel.strategy=fsdp", "parallel.pp=2", f"parallel.pp_schedule={schedule}",
                        "train.micro_batch=1", "train.grad_accum=4", UNTIED]
    for schedule in SCHEDULES
}  # fmt: skip
# Compiled (aot_eager: above), each schedule that runs a micro-batch's backward whole (the
# zero-bubble ones split it, which a compiled block's backward cannot: config/stages.py).
PIPELINE_VARIANTS |= {
    f"pp2_{schedule}_compiled": [*PIPELINE_VARIANTS[f"pp2_{schedule}"], "train.compile=true"]
    for schedule in SCHEDULES
    if schedule not in SPLIT_BACKWARD
}


# A mixture of experts (8 experts, top-2), without its auxiliary terms: the balance term is
# a mean over each micro-batch's tokens, so only the cross entropy's gradient is the same
# for one backward over the whole batch and for any split of it.
MOE = ["model.preset=tiny-moe", "model.moe.aux_loss_weight=0", "model.moe.z_loss_weight=0"]
MOE_VARIANTS = {
    "moe_fsdp_accum": [*MOE, "parallel.strategy=fsdp", "train.micro_batch=1", "train.grad_accum=2"],
    "moe_fsdp_ep2": [*MOE, "parallel.strategy=fsdp", "parallel.ep=2", "train.micro_batch=2"],
    "moe_fsdp_ep2_accum": [*MOE, "parallel.strategy=fsdp", "parallel.ep=2", "train.micro_batch=1", "train.grad_accum=2"],
    "moe_zero3_accum": [*MOE, "parallel.strategy=zero3", "train.micro_batch=1", "train.grad_accum=2", Z3_PARTITION_ALL],
    # The experts whole on each tp rank inside a compiled block (COMPILED_TP_VARIANTS above).
    "moe_fsdp_tp2_compiled": [*MOE, "parallel.strategy=fsdp", "parallel.tp=2", "train.micro_batch=4", "train.compile=true"],
}


# Context parallel (parallel.cp=2: each sequence's 4 chunks of 8 over 2 ranks, keys and
# values all-gathered): on fsdp (the whole batch on each rank) and ddp accumulating; and
# with documents masked (DOCUMENTS: about one token in 8 is the eos 0 that model_spec
# gives the mask without a tokenizer), so the mask must follow the chunks.
DOCUMENTS = "data.document_mask=true"
ULYSSES = "parallel.cp_mode=ulysses"
CP_VARIANTS = {
    "fsdp_cp2": ["parallel.strategy=fsdp", "parallel.cp=2", "train.micro_batch=4"],
    "ddp_cp2_accum": ["parallel.strategy=ddp", "parallel.cp=2", "train.micro_batch=2", "train.grad_accum=2"],
    "fsdp_cp2_documents": ["parallel.strategy=fsdp", "parallel.cp=2", "train.micro_batch=4", DOCUMENTS],
    # DeepSpeed's data-parallel group is every rank: its reduction covers the cp ranks.
    "zero2_cp2": ["parallel.strategy=zero2", "parallel.cp=2", "train.micro_batch=4"],
    # Ulysses (parallel.cp_mode=ulysses: each sequence's 2 runs of 16, heads swapped by all-to-all).
    "ddp_ulysses2_accum": ["parallel.strategy=ddp", "parallel.cp=2", ULYSSES, "train.micro_batch=2", "train.grad_accum=2"],
    # Compiled (aot_eager: above): Ulysses's all-to-alls inside the compiled blocks (the all-gather design
    # refuses compile: config/sequences.py), with and without documents masked.
    "fsdp_ulysses2_compiled": ["parallel.strategy=fsdp", "parallel.cp=2", ULYSSES, "train.micro_batch=4", "train.compile=true"],
    "ddp_ulysses2_documents_compiled": ["parallel.strategy=ddp", "parallel.cp=2", ULYSSES, "train.micro_batch=4", DOCUMENTS,
                                        "train.compile=true"],
    "fsdp_ulysses2_documents": ["parallel.strategy=fsdp", "parallel.cp=2", ULYSSES, "train.micro_batch=4", DOCUMENTS],
    "zero3_ulysses2_accum": ["parallel.strategy=zero3", "parallel.cp=2", ULYSSES, "train.micro_batch=2",
                             "train.grad_accum=2", Z3_PARTITION_ALL],
}  # fmt: skip
# A mixture of experts under cp, its balance and z-loss terms on (the preset's
# sequence_aux, and aux per micro-batch): each rank counts the routing of the whole
# sequences over its cp group; at one micro-batch per rank both equal one process.
# name -> (model overrides, which the test's reference takes too; layout overrides)
MOE_CP_VARIANTS = {
    "moe_fsdp_ulysses2": (["model.preset=tiny-moe"], ["parallel.strategy=fsdp", "parallel.cp=2", ULYSSES,
                                                      "train.micro_batch=4"]),
    "moe_ddp_cp2_aux": (["model.preset=tiny-moe", "model.moe.balance=aux"], ["parallel.strategy=ddp", "parallel.cp=2",
                                                                            "train.micro_batch=4"]),
    "moe_zero3_ulysses2": (["model.preset=tiny-moe"], ["parallel.strategy=zero3", "parallel.cp=2", ULYSSES,
                                                       "train.micro_batch=4", Z3_PARTITION_ALL]),
    # Expert parallel over the cp ranks (the ep group is the cp group): each rank half the
    # experts, their gradients summed over both ranks' tokens and divided by dp x cp.
    "moe_fsdp_ulysses2_ep2": (["model.preset=tiny-moe"], ["parallel.strategy=fsdp", "parallel.cp=2", "parallel.ep=2",
                                                          ULYSSES, "train.micro_batch=4"]),
    "moe_fsdp_cp2_ep2_aux": (["model.preset=tiny-moe", "model.moe.balance=aux"], ["parallel.strategy=fsdp", "parallel.cp=2",
                                                                                 "parallel.ep=2", "train.micro_batch=4"]),
}  # fmt: skip


class FixedBatch:
    """Stands in for PackedTokens: global sample g is row g of one seeded token array; with
    `documents`, every token that is 0 mod 8 becomes the eos 0 (documents of ~8 tokens)."""

    def __init__(self, documents: bool = False) -> None:
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen).numpy()
        if documents:
            self.tokens[self.tokens % 8 == 0] = 0

    def batch(self, indices: range) -> np.ndarray:
        return self.tokens[list(indices)]


def full_grads(engine) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient, by plain name (collective for sharded engines)."""
    out = {}
    module = getattr(engine, "module", engine.model)
    for name, p in module.named_parameters():
        if engine.name.startswith("zero"):
            from deepspeed.utils import safe_get_full_grad

            g = safe_get_full_grad(p)
        elif hasattr(p.grad, "full_tensor"):
            g = p.grad.full_tensor()
        else:
            g = p.grad
        out[plain_name(name)] = g.detach().float().cpu().clone()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("variants", nargs="+")
    args = ap.parse_args()
    world = init_distributed("cpu", "gloo")
    results = {}
    for variant in args.variants:
        layouts = VARIANTS | COMPILED_TP_VARIANTS | PIPELINE_VARIANTS | MOE_VARIANTS | CP_VARIANTS
        layouts |= {name: [*model, *layout] for name, (model, layout) in MOE_CP_VARIANTS.items()}
        engine, spec, cfg = build([*MODEL, *layouts[variant]], world)
        dims = dims_for(cfg.parallel, world.world_size)
        data = FixedBatch(documents=cfg.data.document_mask)
        batches = RankBatches(data, cfg.train.micro_batch, cfg.train.grad_accum, dims.dp_rank(world.rank), dims.dp_size)
        loss = engine.forward_backward(batches.next_step(), spec.loss)
        dist.all_reduce(loss)
        grads = full_grads(engine)
        if getattr(engine, "pipeline", None) is not None:  # each rank holds its own stages' gradients
            grads = engine.pipeline.gather({"grads": grads})["grads"]
        # How many blocks this rank runs compiled (torch.compile's wrapper set), so that a
        # compiled variant that silently ran eager cannot pass as compiled.
        compiled = sum(
            getattr(m, "_compiled_call_impl", None) is not None for m in getattr(engine, "module", engine.model).modules()
        )
        if world.rank == 0:
            results[variant] = {"loss": loss.item() / world.world_size, "grads": grads, "compiled_blocks": compiled}
        del engine  # no live DDP model at teardown (gloo may abort); DDP holds cycles
        gc.collect()
    if world.rank == 0:
        torch.save(results, Path(args.out) / "grads.pt")
    (Path(args.out) / f"rank{world.rank}.json").write_text(json.dumps({"variants": args.variants}))
    shutdown(world)


if __name__ == "__main__":
    main()
