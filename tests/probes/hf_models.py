"""Probe: Hugging Face models on every engine. Run under torchrun, or alone as the reference.

Training: for each case (an architecture from a tiny inline config, an engine), build the
engine exactly as `train` does and run STEPS optimizer steps on one fixed global batch of
GLOBAL_BATCH sequences, this rank taking its contiguous share (one process takes
all of it, so a world-2 run and the one-process reference see the same global batch).
Records the loss (averaged over ranks) and the global gradient norm of every step; for
the LoRA cases also every parameter name and those whose full weights changed.

Loading (--saved DIR, a directory written by save_pretrained): for each engine, build it
with model.path=DIR and compare the engine's full weights with the directory's tensors.

Distillation (--teacher DIR, the same kind of directory): the DISTILL cases train the
built-in student against the saved Llama as teacher, and record besides the teacher's
names whose full weights differ from the directory's after training, and the share of the
teacher's elements rank 0 holds.

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

from scaletrain.engines.block_wrappers import plain_name
from scaletrain.launch.distributed import init_distributed, shutdown
from scaletrain.models import distill_spec

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
# Distillation: the built-in student learns the saved Hugging Face Llama (--teacher DIR);
# pure KL at T=2 on zero3 and ddp, half KL half cross entropy on fsdp. The hidden cases add
# the hidden-state term through the student's projection, 64 wide to the teacher's 32, on
# the engines that shard it (FSDP2's root unit; ZeRO-3 gathering it inside a forward hook).
TEACHER = ["model.teacher.source=hf", "model.teacher.temperature=2.0"]
HIDDEN = [*TEACHER, "model.teacher.hidden_weight=1.0", "model.dim=64"]
DISTILL = {
    "distill-ddp": ("builtin", "ddp", TEACHER),
    "distill-fsdp": ("builtin", "fsdp", [*TEACHER, "model.teacher.kl_weight=0.5"]),
    "distill-zero3": ("builtin", "zero3", TEACHER),
    "distill-hidden-fsdp": ("builtin", "fsdp", HIDDEN),
    "distill-hidden-zero3": ("builtin", "zero3", HIDDEN),
}


def overrides(model: list[str], extra: list[str]) -> list[str]:
    return [*model, f"data.seq_len={SEQ}", "run.device=cpu", *extra]


def inline(arch: dict) -> list[str]:
    return ["model.source=hf", f"model.hf_config={json.dumps(arch)}"]


def train_case(arch: str, engine_name: str, extra: list[str], world, teacher_dir: str) -> dict[str, list]:
    share = GLOBAL_BATCH // world.world_size
    model = BUILTIN if arch == "builtin" else inline(ARCHS[arch])
    engine, spec, cfg = build(overrides(model, [*ENGINES[engine_name], *extra, f"train.micro_batch={share}"]), world)
    distill = distill_spec(cfg, spec)
    loss_fn = distill.loss if distill else spec.loss
    lora = any(e.startswith("model.lora") for e in extra)
    before = {plain_name(k): v.clone() for k, v in engine.full_weights().items()} if lora else {}  # collective
    # One global batch, every step: the same on every rank and world size, and one the
    # model visibly learns (random tokens afresh each step would leave the loss flat).
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    mine = tokens[world.rank * share : (world.rank + 1) * share]
    losses, norms = [], []
    for _ in range(STEPS):
        loss = engine.forward_backward([(mine[:, :-1], mine[:, 1:])], loss_fn).detach().clone()
        if world.world_size > 1:
            dist.all_reduce(loss)
        losses.append(loss.item() / world.world_size)
        norms.append(float(engine.step(1e-2).grad_norm))
    after = {plain_name(k): v for k, v in engine.full_weights().items()} if lora else {}
    teacher = teacher_state(engine.teacher, Path(teacher_dir)) if distill else {}  # collective
    del engine
    gc.collect()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    return {"losses": losses, "grad_norms": norms, "names": sorted(before), "changed": changed} | teacher


def teacher_state(teacher, directory: Path) -> dict:
    """The teacher's names whose full weights differ from the directory's (bf16 there,
    fp32 here: exact), and the share of its elements this rank holds."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    module = getattr(teacher, "module", teacher)  # a DeepSpeed engine holds it as .module
    params = dict(module.named_parameters())
    if hasattr(next(iter(params.values())), "ds_tensor"):  # ZeRO-3 partitions
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        local = sum(p.ds_tensor.numel() for p in params.values())
        with GatheredParameters(list(params.values())):
            full = {n: p.detach().clone() for n, p in params.items()}
    else:
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params.values())
        full = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in params.items()}
    want = load_file(str(directory / "model.safetensors"))
    differ = sorted(n for n in full if n not in want or not torch.equal(full[n], want[n].float()))
    return {"teacher_differ": differ, "teacher_names": len(full), "teacher_share": local / sum(p.numel() for p in full.values())}


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
    ap.add_argument("--teacher", required=True, help="a save_pretrained directory of the LLAMA config, vocabulary VOCAB")
    args = ap.parse_args()
    world = init_distributed("cpu", "gloo")
    cases = CASES | {name: (a, e, [*x, f"model.teacher.path={args.teacher}"]) for name, (a, e, x) in DISTILL.items()}
    results: dict = {name: train_case(arch, eng, extra, world, args.teacher) for name, (arch, eng, extra) in cases.items()}
    if args.saved:
        results["loaded"] = {s: loaded_differences(Path(args.saved), s, world) for s in ENGINES}
    if world.rank == 0:
        (Path(args.out) / "hf_models.json").write_text(json.dumps(results))
    if world.world_size > 1:
        dist.barrier()
    shutdown(world)


if __name__ == "__main__":
    main()
