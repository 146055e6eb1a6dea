"""Probe: Hugging Face models on every engine. Run under torchrun, or alone as the reference.

Training: for each case (an architecture from a tiny inline config, an engine), build the
engine exactly as `train` does and run STEPS optimizer steps on one fixed global batch of
GLOBAL_BATCH sequences, this rank taking its contiguous share (one process takes
all of it, so a world-2 run and the one-process reference see the same global batch).
Records the loss (averaged over ranks) and the global gradient norm of every step; for
the LoRA cases also every parameter name and those whose full weights changed.

Loading (--saved DIR, a directory written by save_pretrained): for each engine, build it
with model.path=DIR and compare the engine's full weights with the directory's tensors.

Rank 0 writes OUT/hf_models.json: {case: {"losses": [...], "grad_norms": [...]}, "loaded":
{strategy: [names whose weights differ from the directory's]}}.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist

from scaletrain.distributed import init_distributed, shutdown
from scaletrain.engines.checkpointing import plain_name

from common import Z3_PARTITION_ALL, build

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 4, 16, 96
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": VOCAB}  # fmt: skip
# GPT-2's own defaults drop out 10% everywhere: off, or no two runs could agree.
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": VOCAB,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # fmt: skip
ARCHS = {"llama": LLAMA, "gpt2": GPT2}
ENGINES = {
    "ddp": ["parallel.strategy=ddp"],
    "fsdp": ["parallel.strategy=fsdp", "parallel.activation_checkpointing=true"],  # the decoder layers wrapped twice
    "zero3": ["parallel.strategy=zero3", Z3_PARTITION_ALL],
}
LORA = "model.lora={r: 4, alpha: 8}"  # default targets: q_proj, v_proj (peft's for llama); wq..wo (built-in)
BUILTIN = [f"model.vocab_size={VOCAB}", "model.dim=32", "model.n_layers=2", "model.n_heads=2",
           "model.n_kv_heads=1", "model.ffn_dim=48"]  # fmt: skip
CASES = {f"{a}-{e}": (a, e, []) for a in ARCHS for e in ENGINES if not (a == "gpt2" and e == "ddp")} | {
    "llama-lora-ddp": ("llama", "ddp", [LORA]),
    "llama-lora-fsdp": ("llama", "fsdp", [LORA]),
    "builtin-lora-zero3": ("builtin", "zero3", [LORA]),
}


def overrides(model: list[str], extra: list[str]) -> list[str]:
    return [*model, f"data.seq_len={SEQ}", "run.device=cpu", *extra]


def inline(arch: dict) -> list[str]:
    return ["model.source=hf", f"model.hf_config={json.dumps(arch)}"]


def train_case(arch: str, engine_name: str, extra: list[str], world) -> dict[str, list]:
    share = GLOBAL_BATCH // world.world_size
    model = BUILTIN if arch == "builtin" else inline(ARCHS[arch])
    engine, spec, cfg = build(overrides(model, [*ENGINES[engine_name], *extra, f"train.micro_batch={share}"]), world)
    before = {plain_name(k): v.clone() for k, v in engine.full_weights().items()} if extra else {}  # collective
    # One global batch, every step: the same on every rank and world size, and one the
    # model visibly learns (random tokens afresh each step would leave the loss flat).
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    mine = tokens[world.rank * share : (world.rank + 1) * share]
    losses, norms = [], []
    for _ in range(STEPS):
        loss = engine.forward_backward([(mine[:, :-1], mine[:, 1:])], spec.loss).detach().clone()
        if world.world_size > 1:
            dist.all_reduce(loss)
        losses.append(loss.item() / world.world_size)
        norms.append(float(engine.step(1e-2).grad_norm))
    after = {plain_name(k): v for k, v in engine.full_weights().items()} if extra else {}
    del engine
    gc.collect()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    return {"losses": losses, "grad_norms": norms, "names": sorted(before), "changed": changed}


def loaded_differences(saved: Path, strategy: str, world) -> list[str]:
    from safetensors.torch import load_file

    engine, _, _ = build(
        overrides(["model.source=hf", f"model.path={saved}"], [*ENGINES[strategy], "train.micro_batch=1"]), world
    )
    got = {plain_name(k): v for k, v in engine.full_weights().items()}  # collective
    want = load_file(str(saved / "model.safetensors"))
    del engine
    gc.collect()
    differ = sorted(k for k in want if k not in got or not torch.equal(got[k], want[k].float()))
    return differ + sorted(set(got) - set(want) - {"lm_head.weight"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--saved", default=None)
    args = ap.parse_args()
    world = init_distributed("cpu", "gloo")
    results: dict = {name: train_case(arch, eng, extra, world) for name, (arch, eng, extra) in CASES.items()}
    if args.saved:
        results["loaded"] = {s: loaded_differences(Path(args.saved), s, world) for s in ENGINES}
    if world.rank == 0:
        (Path(args.out) / "hf_models.json").write_text(json.dumps(results))
    if world.world_size > 1:
        dist.barrier()
    shutdown(world)


if __name__ == "__main__":
    main()
