"""Published multi-GPU training throughputs with their exact settings, for the planner's clock
to predict (`scaletrain bench --suite clock-published`; bench/clock_recorded.py compares).

Each entry is the published run as scaletrain would configure it: the model's shape, the
sequence, the micro-batch and the global batch, the layout (FSDP degree, tp, cp), activation
checkpointing, torch.compile and float8 where the source names them; the measured figure is
the source's tokens per second per GPU, turned into seconds per optimizer step (global batch
x sequence / (tokens/s/GPU x GPUs)). What scaletrain cannot configure as the source ran it is
said in `differs` (the table prints it).

Sources (read in the stored public repositories; the settings as each states them):
- torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (commit 820504e) and
  benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (8b6770a): Llama 3.1 8B, 70B and 405B
  on H100 with 96 GB HBM2e at a 500 W power limit, NVLink in a node, 400 Gb/s RDMA per GPU;
  sequence 8192 (the presets of the benchmarked commit) unless a table names another, bf16
  unless float8 is named. Its tables 1-5 are here; table 6 (405B with cp beside pp) is not:
  scaletrain refuses cp with pp. Its pipelines split each dp rank's batch into as many
  micro-batches as pp (the benchmarked commit's default), and its interleaved 1F1B runs two
  stages a rank (its default split points for a looped schedule).
- llm-foundry, scripts/train/benchmarking/README.md (commit 8c8dd48), "H100 80GB BF16": MPT
  models (vocabulary 50368, tied embeddings, multi-head attention, a GELU MLP of 4 x d_model,
  learned positions, biases) under FSDP (FULL_SHARD), amp_bf16, flash attention, its
  low-precision LayerNorm; no torch.compile (submit_benchmarks.py sets none).
- NeMo AutoModel, docs/performance-summary.mdx (NVIDIA-NeMo/Automodel 36044ad): Llama 3.1 70B
  pretraining on 64 DGX-H100 GPUs, FSDP2 32 x cp 2, bf16, torch.compile, activation checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peaks:
    """A GPU's dense peaks where a source bounds them (bench/clock_recorded.py plans with them too)."""

    bf16: float  # FLOP/s
    float8: float  # FLOP/s
    memory_bw: float  # bytes/s
    said: str  # what they are, for the table's note


# torchtitan's H100s, by its own footnote: a peak "between SXM and NVL", and 2.4 TB/s of HBM2e.
# The lower bound: the H100 NVL's datasheet (1,671 and 3,341 TFLOP/s with sparsity: dense is half).
TITAN_LOWER = Peaks(
    835e12,
    1670e12,
    2.4e12,
    "the source's lower bound (the H100 NVL's peaks, 835 TFLOP/s bf16, 1,670 float8; its stated 2.4 TB/s)",
)


@dataclass(frozen=True)
class Published:
    source: str
    name: str
    gpus: int
    tokens_per_gpu_s: float
    global_batch: int  # sequences per optimizer step
    seq_len: int
    overrides: tuple[str, ...]
    memory_gib: int = 80  # per GPU
    differs: str = ""  # what scaletrain cannot configure as the source ran it
    lower: Peaks | None = None  # the source's lower bound of its GPU's peaks, planned with as well

    @property
    def step_s(self) -> float:
        return self.global_batch * self.seq_len / (self.tokens_per_gpu_s * self.gpus)


def _mpt(d: int, layers: int, heads: int) -> tuple[str, ...]:
    """An MPT shape as the built-in decoder: the same parameters and FLOPs per token, its GELU MLP
    of 2 matrices of d x 4d as a SwiGLU of 3 matrices of d x 8d/3."""
    return (
        "model.preset=7b",
        f"model.dim={d}",
        f"model.n_layers={layers}",
        f"model.n_heads={heads}",
        f"model.n_kv_heads={heads}",
        f"model.ffn_dim={round(8 * d / 3)}",
        "model.vocab_size=50368",
        "model.tie_embeddings=true",
        "train.compile=false",  # the source's runs were not compiled (its own fused kernels: module docstring)
    )


TITAN = "torchtitan llama3_h100_202412"
ASYNC_TP = "torchtitan asyncTP_llama3_h100_2025-06"
FOUNDRY = "llm-foundry H100 80GB BF16"
TITAN_H100 = "H100 96 GB HBM2e at 500 W (below the SXM datasheet's clock: the planner's H100 is the 700 W SXM)"
# torchtitan's per-op selective checkpointing, as parallel.ac_mode=selective runs it (models/selective_ac.py).
SAC = ("parallel.activation_checkpointing=true", "parallel.ac_mode=selective")
BF16 = ("precision=bf16", "parallel.strategy=fsdp")
L8B = ("model.preset=8b", "data.seq_len=8192", *BF16, *SAC)
MPT = "MPT's GELU MLP as a SwiGLU of equal FLOPs, learned positions and biases left out"
FULL_AC = ("parallel.activation_checkpointing=true",)
# scaletrain trains float8 with neither tp nor pp (config/float8.py): those runs are planned in bf16.
NO_FLOAT8 = f"{TITAN_H100}; float8 in the source, planned in bf16 (scaletrain does not combine float8 with tp)"
NO_ASYNC_TP = f"{NO_FLOAT8}; async tensor parallel in the source, planned as plain tp (scaletrain has none)"
# torchtitan's context parallel is torch's ring attention (context_parallel, its keys and values all-gathered), compiled.
RING = (
    f"{TITAN_H100}; torch's ring attention in the source, planned as Ulysses (the same attention FLOPs a rank; "
    "scaletrain's all-gather design does not compile)"
)


def _long(cp: int, seq: int) -> tuple[str, ...]:
    """torchtitan's table 2: the 8B at one sequence a rank, compiled, float8, full checkpointing."""
    ulysses = ("parallel.cp_mode=ulysses",) if cp > 1 else ()
    return ("model.preset=8b", f"data.seq_len={seq}", *BF16, *FULL_AC, f"parallel.cp={cp}", *ulysses, "train.micro_batch=1",
            f"train.global_batch={8 // cp}", "train.compile=true", "train.float8=true")  # fmt: skip


def _titan_405b(schedule: str) -> tuple[str, ...]:
    """torchtitan's table 5: 405B on 512 GPUs, FSDP 8 x TP 8 x PP 8, 32 sequences a dp rank in 8 micro-batches."""
    return ("model.preset=405b", "data.seq_len=8192", *BF16, "parallel.tp=8", "parallel.pp=8",
            f"parallel.pp_schedule={schedule}", *FULL_AC, "train.micro_batch=4", "train.global_batch=256",
            "train.compile=true")  # fmt: skip


PUBLISHED = (
    Published(TITAN, "Llama 3.1 8B, FSDP 8, eager", 8, 5762, 16, 8192, (*L8B, "train.micro_batch=2", "train.global_batch=16",
              "train.compile=false"), 96, TITAN_H100, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 8B, FSDP 8, compiled", 8, 6667, 16, 8192, (*L8B, "train.micro_batch=2", "train.global_batch=16",
              "train.compile=true"), 96, TITAN_H100, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 8B, FSDP 8, compiled, float8", 8, 8532, 16, 8192, (*L8B, "train.micro_batch=2",
              "train.global_batch=16", "train.compile=true", "train.float8=true"), 96, TITAN_H100, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 8B, FSDP 8, seq 32768, compiled, float8, full AC", 8, 3890, 8, 32768, _long(1, 32768), 96,
              TITAN_H100, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 8B, FSDP 4 x cp 2, seq 65536, compiled, float8, full AC", 8, 2540, 4, 65536,
              _long(2, 65536), 96, RING, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 8B, FSDP 2 x cp 4, seq 131072, compiled, float8, full AC", 8, 1071, 2, 131072,
              _long(4, 131072), 96, RING, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 8B, cp 8, seq 262144, compiled, float8, full AC", 8, 548, 1, 262144, _long(8, 262144), 96,
              RING, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 8B, FSDP 128, eager", 128, 5605, 256, 8192, (*L8B, "train.micro_batch=2",
              "train.global_batch=256", "train.compile=false"), 96, TITAN_H100, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 8B, FSDP 128, compiled", 128, 6514, 256, 8192, (*L8B, "train.micro_batch=2",
              "train.global_batch=256", "train.compile=true"), 96, TITAN_H100, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 8B, FSDP 128, compiled, float8", 128, 8380, 256, 8192, (*L8B, "train.micro_batch=2",
              "train.global_batch=256", "train.compile=true", "train.float8=true"), 96, TITAN_H100, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 70B, FSDP 32 x TP 8, compiled, float8, full AC", 256, 829, 512, 8192, ("model.preset=70b",
              "data.seq_len=8192", *BF16, "parallel.tp=8", *FULL_AC, "train.micro_batch=16", "train.global_batch=512",
              "train.compile=true"), 96, NO_FLOAT8, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 70B, FSDP 32 x TP 8, compiled, float8, async TP, full AC", 256, 876, 512, 8192, (
              "model.preset=70b", "data.seq_len=8192", *BF16, "parallel.tp=8", *FULL_AC, "train.micro_batch=16",
              "train.global_batch=512", "train.compile=true"), 96, NO_ASYNC_TP, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 405B, FSDP 8 x TP 8 x PP 8 (1F1B), compiled, float8, async TP, full AC", 512, 100, 256, 8192,
              _titan_405b("1f1b"), 96, NO_ASYNC_TP, TITAN_LOWER),
    Published(TITAN, "Llama 3.1 405B, FSDP 8 x TP 8 x PP 8 (interleaved 1F1B), compiled, float8, async TP, full AC", 512, 128,
              256, 8192, _titan_405b("interleaved_1f1b"), 96, NO_ASYNC_TP, TITAN_LOWER),
    Published(ASYNC_TP, "Llama 3 8B, FSDP 8 x TP 8, compiled", 64, 4378, 96, 8192, (*L8B, "parallel.tp=8", "train.micro_batch=12",
              "train.global_batch=96", "train.compile=true"), 96, TITAN_H100, TITAN_LOWER),
    Published(ASYNC_TP, "Llama 3 70B, FSDP 32 x TP 8, compiled, full AC", 256, 597.3, 512, 8192, ("model.preset=70b",
              "data.seq_len=8192", *BF16, "parallel.tp=8", "parallel.activation_checkpointing=true", "train.micro_batch=16",
              "train.global_batch=512", "train.compile=true"), 96, TITAN_H100, TITAN_LOWER),
    Published(FOUNDRY, "MPT-1b, 8 GPUs, seq 2048", 8, 45455, 112, 2048, (*_mpt(2048, 24, 16), "data.seq_len=2048", *BF16,
              "train.micro_batch=14", "train.global_batch=112"), 80, MPT),
    Published(FOUNDRY, "MPT-7b, 8 GPUs, seq 2048", 8, 10643, 48, 2048, (*_mpt(4096, 32, 32), "data.seq_len=2048", *BF16,
              "train.micro_batch=6", "train.global_batch=48"), 80, MPT),
    Published(FOUNDRY, "MPT-13b, 8 GPUs, seq 2048", 8, 4792, 16, 2048, (*_mpt(5120, 40, 40), "data.seq_len=2048", *BF16,
              "train.micro_batch=2", "train.global_batch=16"), 80, MPT),
    Published(FOUNDRY, "MPT-30b, 8 GPUs, seq 2048, AC", 8, 2002, 504, 2048, (*_mpt(7168, 48, 56), "data.seq_len=2048", *BF16,
              "parallel.activation_checkpointing=true", "train.micro_batch=3", "train.global_batch=504"), 80, MPT),
    Published(FOUNDRY, "MPT-70b, 64 GPUs, seq 2048, AC", 64, 1039, 2048, 2048, (*_mpt(8192, 80, 64), "data.seq_len=2048", *BF16,
              "parallel.activation_checkpointing=true", "train.micro_batch=8", "train.global_batch=2048"), 80, MPT),
    Published(FOUNDRY, "MPT-7b, 8 GPUs, seq 8192, AC", 8, 6935, 128, 8192, (*_mpt(4096, 32, 32), "data.seq_len=8192", *BF16,
              "parallel.activation_checkpointing=true", "train.micro_batch=8", "train.global_batch=128"), 80, MPT),
    Published("NeMo AutoModel performance summary", "Llama 3.1 70B, FSDP2 32 x cp 2, compiled, AC", 64, 866.77, 128, 8192, (
              "model.preset=70b", "data.seq_len=8192", *BF16, "parallel.cp=2", "parallel.activation_checkpointing=true",
              "train.micro_batch=1", "train.global_batch=128", "train.compile=false"), 80,
              "Transformer Engine's context parallel (a ring of key/value passes) as scaletrain's all-gather design; compiled in "
              "the source; scaletrain compiles Ulysses cp only (the all-gather design's mask does not trace): planned eager"),
)  # fmt: skip
