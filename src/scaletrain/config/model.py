"""The config's model sections: which model (built-in preset or Hugging Face), its shape,
LoRA, a mixture of experts, a teacher. Part of the one schema in scaletrain/config.py,
which re-exports these names; kept apart so that each file stays one read.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scaletrain.config.presets import PRESETS
from scaletrain.config.sources import SOURCES, source_problem

MODEL_PRESETS = tuple(PRESETS)
MOE_PRESETS = tuple(name for name, shape in PRESETS.items() if shape.get("experts"))  # mixtures of experts (models/moe.py)


class Section(BaseModel):
    # extra="forbid": a misspelt key is an error, never silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSection(Section):
    r: int = Field(8, ge=1)  # rank of the adapters
    alpha: int = Field(16, ge=1)  # the adapters' output is scaled by alpha / r (an int, as in peft)
    dropout: float = Field(0.0, ge=0, lt=1)
    # Names (suffixes) of the Linear modules to adapt. Empty: the built-in model's attention
    # projections (wq, wk, wv, wo), or peft's default for a Hugging Face model_type.
    target_modules: list[str] = Field(default_factory=list)


class MoeSection(Section):
    """A mixture of experts in the built-in model's feed-forward (models/moe.py). Unset
    fields keep the preset's (tiny-moe, mixtral-8x7b, deepseek-moe-16b) or the defaults
    noted; `model.moe={}` turns any built-in preset into 8 experts, top-2."""

    experts: int | None = Field(None, ge=2)  # 8
    top_k: int | None = Field(None, ge=1)  # 2
    shared_experts: int | None = Field(None, ge=0)  # 0; DeepSeekMoE's always-on experts
    expert_ffn_dim: int | None = Field(None, ge=1)  # model.ffn_dim
    dense_layers: int | None = Field(None, ge=0)  # 0; the first N blocks keep a dense feed-forward
    capacity_factor: float | None = Field(None, ge=0)  # 0: dropless; else slots per expert = cf x tokens x top_k / experts
    normalize_top_k: bool | None = None  # True: the top-k router weights sum to 1 (Mixtral)
    # The balance loss's weight (Switch): 0.02 (Mixtral's coefficient), 0.0001 with balance=bias
    # (DeepSeek-V3's sequence-wise term beside its bias).
    aux_loss_weight: float | None = Field(None, ge=0)
    # How the experts' load is balanced (docs/moe.md): sequence_aux, a balance loss counted
    # per sequence and averaged (linear in sequences: the numbers depend on the global batch
    # only, however it is split into micro-batches and ranks); aux, counted per micro-batch
    # (Switch, Mixtral, torchtitan: Hugging Face Mixtral's numbers, which change with the
    # micro-batch); bias, DeepSeek-V3's loss-free balancing: a per-expert bias added to the
    # scores for choosing the experts only, moved by bias_update_rate x sign(mean load - load)
    # after each optimizer step from the load of the whole step (every micro-batch and rank),
    # beside the per-sequence loss at aux_loss_weight.
    balance: Literal["sequence_aux", "aux", "bias"] = "sequence_aux"
    bias_update_rate: float = Field(0.001, gt=0)  # balance=bias: DeepSeek-V3's gamma
    # The router's scores: softmax over the experts (Mixtral, Qwen), or each expert's sigmoid
    # (DeepSeek-V3), the chosen ones' renormalized where normalize_top_k. Default softmax.
    score: Literal["softmax", "sigmoid"] | None = None
    # Group-limited routing (DeepSeek-V3): the experts in `groups` contiguous groups (under
    # expert parallelism a group's experts sit on the same ranks), each token's top_k chosen
    # within its topk_groups best groups (a group's score: its best score with softmax, the
    # sum of its best two with sigmoid). 1 and 1: no limit.
    groups: int | None = Field(None, ge=1)
    topk_groups: int | None = Field(None, ge=1)
    z_loss_weight: float = Field(0.001, ge=0)  # router z-loss (ST-MoE)
    # How the experts run (the same numbers): grouped, one torch._grouped_mm per projection,
    # nothing read back to the host; loop, one matmul per expert after one .tolist() of the
    # token counts per layer and forward; auto, grouped where torch runs it without a host
    # sync and in compiled blocks, else loop (docs/moe.md).
    experts_impl: Literal["auto", "grouped", "loop"] = "auto"


class ModelSource(Section):
    """Which model, and its shape: the trained model's fields, and a teacher's."""

    where: ClassVar[str] = "model"  # the key path in messages
    # builtin: scaletrain's own Llama, shaped by the preset and the fields below. hf: a
    # Hugging Face causal LM from a local directory (path) or an inline config (hf_config).
    # python: a model of your own, the spec a function returns (models/module_spec.py).
    # Every name, its keys and what it offers: config/sources.py SOURCES.
    source: str = "builtin"
    path: str | None = None  # source hf: a local directory written by save_pretrained
    hf_config: dict[str, Any] | None = None  # source hf: {model_type: llama, hidden_size: ...}
    # source python: "package.module:function", imported on every rank, called with spec_args
    # (and vocab_size, the tokenizer's, unless spec_args gives it); it returns scaletrain.ModuleSpec(...).
    spec: str | None = None
    spec_args: dict[str, Any] = Field(default_factory=dict)
    preset: Literal[MODEL_PRESETS] = "tiny"  # type: ignore[valid-type]
    # Each shape field overrides the preset when set; vocab_size defaults to the tokenizer's.
    vocab_size: int | None = Field(None, ge=2)
    dim: int | None = Field(None, ge=8)
    n_layers: int | None = Field(None, ge=1)
    n_heads: int | None = Field(None, ge=1)
    n_kv_heads: int | None = Field(None, ge=1)
    ffn_dim: int | None = Field(None, ge=1)
    tie_embeddings: bool | None = None
    rope_theta: float | None = Field(None, gt=0)
    norm_eps: float | None = Field(None, gt=0)  # the preset's (1e-5 for most, 1e-6 for DeepSeekMoE and Qwen3)
    moe: MoeSection | None = None  # a mixture of experts (built-in model only)

    @field_validator("source")
    @classmethod
    def _known_source(cls, v: str) -> str:
        if v not in SOURCES:
            raise ValueError(f"{cls.where}.source={v} is not one scaletrain builds; accepted: {'|'.join(SOURCES)}")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        problem = source_problem(self, self.where)  # config/sources.py: the source's checks and keys
        if problem:
            raise ValueError(problem)
        return self


class TeacherConfig(ModelSource):
    """A frozen model the trained one (the student) learns from: never optimized, never
    saved in checkpoints (it is rebuilt from this section on resume), sharded like the student.
    The loss is kl_weight x T^2 x KL(teacher || student at temperature T) + (1 - kl_weight)
    x the next-token cross entropy (Hinton et al.'s T^2 keeps the gradient scale as T grows),
    + hidden_weight x the mean squared error between the student's final hidden states,
    projected to the teacher's width by a trained linear map, and the teacher's."""

    where: ClassVar[str] = "model.teacher"
    temperature: float = Field(1.0, gt=0)
    kl_weight: float = Field(1.0, ge=0, le=1)
    # 0: off. Else the student gains `distill_proj` (student width -> teacher width, no
    # bias), trained and checkpointed with it, left out of Hugging Face exports.
    hidden_weight: float = Field(0.0, ge=0)


class ModelConfig(ModelSource):
    # Glob patterns over parameter names ("layers.*.attention.*"): only the parameters they
    # match are trained, every other one is frozen (no gradient, no optimizer state).
    # Empty: everything trains.
    trainable: list[str] = Field(default_factory=list)
    # LoRA through peft: the base is frozen, adapters train (plus any model.trainable). None: off.
    lora: LoraSection | None = None
    # Distillation: a frozen teacher whose output distribution the model learns. None: off.
    teacher: TeacherConfig | None = None

    @model_validator(mode="after")
    def _lora_source(self) -> ModelConfig:
        if self.lora is not None and not SOURCES[self.source].lora:
            raise ValueError(
                "model.lora adapts the built-in or a Hugging Face model's known layers; accepted: model.lora with "
                "model.source=builtin|hf, or adapters inside a model of your own"
            )
        return self


def compiled_experts_problem(cfg: Any) -> str | None:
    """train.compile with model.moe.experts_impl=loop (cfg: the whole Config), or None."""
    if cfg.train.compile and cfg.model.moe is not None and cfg.model.moe.experts_impl == "loop":
        return (
            "train.compile=true with model.moe.experts_impl=loop: the loop reads the token counts on the host (.tolist()), "
            "which would break the compiled block's graph; accepted: model.moe.experts_impl=auto|grouped, or train.compile=false"
        )
    return None
