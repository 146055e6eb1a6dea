"""What a run gets without flags on the device it runs on: the one place that decides it.

A key the user set (in a file or as an override) is theirs and stays; a key left unset
takes the device's default. On a CPU the defaults are the config's own (config/schema.py); on an
NVIDIA GPU some differ, each for a reason docs/gpu.md's table gives:

  precision                        bf16 (fp16 where the GPU has no bf16 tensor cores)
  train.micro_batch                auto: the largest the plan fits, at the same global batch
  train.loss_chunk_tokens          from a 64k vocabulary up, chunks of ~2**28 logits
  parallel.activation_checkpointing  only where nothing fits without it: selective where that fits
  train.compile                    where the layout allows it and it pays back its compile time

(Fused AdamW is not a key: every torch engine uses it wherever torch has the kernel, CPU
included, optim.build_adamw; DeepSpeed builds its own FusedAdam on a GPU.)

`before_plan` decides what needs no plan; `after_plan` what does (does anything fit, what
does a step cost). The run's first lines say which were applied (trainer -> preflight).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scaletrain.config import AUTO_MICRO_BATCH, Config
from scaletrain.config.batch import global_batch

# The cross entropy's fp32 logits and their fp32 gradient are the largest tensors of a step
# from here up (a 128k vocabulary at 16 x 4096 tokens: 34 GB each, models/loss.py).
CHUNK_FROM_VOCAB = 65536
CHUNK_LOGITS = 2**28  # logits per chunk: 1 GiB in fp32, a few percent of a GPU's memory
# train.compile: what compiling the blocks costs once and saves per step, as measured on a lent
# H200 (docs/gpu.md): the 1b preset at micro-batch 16 x 2048 tokens stepped in 672 ms eager and
# 477 ms compiled (29%) in one call, 667 and 547 ms (18%) in another, so the smaller saving is
# counted; its first log interval took 17.4 s more than the steady ones with a fresh inductor
# cache (the Hugging Face Llama's 9.8 s; each block is one compiled graph), counted as 20 s.
COMPILE_SECONDS = 20.0
COMPILE_GAIN = 0.18
DEFAULT_GLOBAL_SEQUENCES_PER_RANK = 16  # the config's micro_batch default, kept as the global batch

KEYS = (
    "precision",
    "train.micro_batch",
    "train.loss_chunk_tokens",
    "train.compile",
    "parallel.activation_checkpointing",
    "parallel.ac_mode",
)


@dataclass(frozen=True)
class Target:
    """The device a run trains on, as far as its defaults go."""

    type: str  # "cuda" | "cpu"
    name: str = ""
    bf16: bool = True  # bf16 tensor cores (NVIDIA compute capability 8.0 and later)

    @property
    def gpu(self) -> bool:
        return self.type == "cuda"


def unset(cfg: Config) -> frozenset[str]:
    """The keys of KEYS nobody set: what the device decides (read before anything updates cfg)."""
    sections = {"train": cfg.train, "parallel": cfg.parallel}
    out = set()
    for key in KEYS:
        section, _, field = key.rpartition(".")
        holder = sections[section] if section else cfg
        if field not in holder.model_fields_set:
            out.add(key)
    return frozenset(out)


def before_plan(cfg: Config, target: Target, vocab_size: int, dp: int, free: frozenset[str]) -> tuple[Config, list[str]]:
    """Precision, the chunked loss and an automatic micro-batch, where `free` leaves them to
    the device; with the reasons, one each."""
    if not target.gpu:
        return cfg, []
    t, applied = cfg.train, []
    top: dict[str, Any] = {}
    train: dict[str, Any] = {}
    if "precision" in free:
        top["precision"] = "bf16" if target.bf16 else "fp16"
        why = "bf16 tensor cores, no loss scaling" if target.bf16 else "no bf16 tensor cores here: fp16 with loss scaling"
        applied.append(f"precision={top['precision']} ({why})")
    if "train.loss_chunk_tokens" in free and vocab_size >= CHUNK_FROM_VOCAB:
        train["loss_chunk_tokens"] = chunk_tokens(vocab_size)
        applied.append(
            f"train.loss_chunk_tokens={train['loss_chunk_tokens']} (vocabulary {vocab_size} >= {CHUNK_FROM_VOCAB}: "
            "the fp32 logits and their gradient never whole)"
        )
    if "train.micro_batch" in free and t.micro_batch != AUTO_MICRO_BATCH:
        train["micro_batch"] = AUTO_MICRO_BATCH
        if t.global_batch is None:
            train["global_batch"] = global_batch(t, dp)
        applied.append(
            f"train.micro_batch=auto (the largest the plan fits, at the global batch of {train.get('global_batch', t.global_batch)})"
        )
    if train:
        top["train"] = t.model_copy(update=train)
    return (cfg.model_copy(update=top) if top else cfg), applied


def chunk_tokens(vocab_size: int) -> int:
    """Positions per chunk of the cross entropy: ~CHUNK_LOGITS logits, a power of two >= 256."""
    n = 256
    while n * 2 * vocab_size <= CHUNK_LOGITS:
        n *= 2
    return n


def after_plan(
    cfg: Config,
    target: Target,
    free: frozenset[str],
    plan: Callable[[Config], tuple[bool, float]],
    allowed: Callable[[Config], bool],
) -> tuple[Config, list[str]]:
    """Activation checkpointing where nothing fits without it, and compile where it pays.
    `plan(cfg)` -> (fits, estimated step seconds) for a config; `allowed(cfg)` whether the
    config's own rules accept it (compile is offered on some layouts only)."""
    if not target.gpu:
        return cfg, []
    applied = []
    fits, step_s = plan(cfg)
    if "parallel.activation_checkpointing" in free and not fits and not cfg.parallel.activation_checkpointing:
        # Selective first where the user left the mode to us: it keeps more and repeats less.
        modes = ("selective", "full") if "parallel.ac_mode" in free else (cfg.parallel.ac_mode,)
        for mode in modes:
            checkpointed = _with(cfg, "parallel", activation_checkpointing=True, ac_mode=mode)
            fits_then, step_then = plan(checkpointed)
            if fits_then:
                cfg, step_s = checkpointed, step_then
                what = "selective, parallel.ac_mode=selective" if mode == "selective" else "full"
                applied.append(
                    f"parallel.activation_checkpointing=true ({what}: nothing fits without it; the recompute costs "
                    f"{'part of a forward' if mode == 'selective' else '~1/3 of a step'})"
                )
                break
    if "train.compile" in free and not cfg.train.compile:
        compiled = _with(cfg, "train", compile=True)
        saved = cfg.train.steps * step_s * COMPILE_GAIN
        if not allowed(compiled):
            pass  # the layout does not offer it: said by the config itself when asked for
        elif saved > COMPILE_SECONDS:
            cfg = compiled
            applied.append(
                f"train.compile=true ({cfg.train.steps} steps of ~{step_s:.2f} s: ~{saved:.0f} s saved against "
                f"~{COMPILE_SECONDS:.0f} s of compiling)"
            )
        else:
            applied.append(
                f"train.compile=false ({cfg.train.steps} steps of ~{step_s:.2f} s: ~{saved:.0f} s saved would not pay "
                f"~{COMPILE_SECONDS:.0f} s of compiling)"
            )
    return cfg, applied


def _with(cfg: Config, section: str, **changes: Any) -> Config:
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=changes)})
