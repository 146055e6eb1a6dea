"""Hugging Face causal language models as a model spec (`model.source: hf`).

The model comes from a local directory (`model.path`: its config.json and safetensors
weights, `from_pretrained`'s layout) or from an inline config (`model.hf_config`: any
`model_type` transformers knows, built with `from_config`). Nothing is fetched: the hub
is switched off before transformers is imported.

Everything engine-facing goes through the model's own structure, never a name list per
architecture: the repeated blocks are the ModuleList whose children are the classes the
model itself declares unsplittable (`_no_split_modules`, what HF's own device maps and
FSDP wrapping policies use); the planner's traced block is the model's first decoder
layer called with exactly the arguments the model passes it (captured by a hook on a
one-layer copy under fake tensors), so rotary tables, masks and position ids come from the
architecture's own code.

Weights are built on the meta device and materialized by the engine (sharded first under
FSDP): from the directory one tensor at a time (read from the memory-mapped safetensors,
cast to the engine's fp32 master dtype, and copied into this rank's shard), so no rank
ever holds a second full copy of the model; or, for an inline config, by the same
per-parameter seeded init as the built-in Llama (N(0, initializer_range) for matmul and
embedding weights, ones and zeros for norms, zeros for biases: HF's own `_init_weights`
rule) so values do not depend on the engine or the sharding. Non-persistent buffers
(rotary inverse frequencies) are recomputed by the model's own `_init_weights`.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.capture import CapturedCall, first_call
from scaletrain.models.counts import ModelCounts, counts_of
from scaletrain.models.lora import LoraSpec, apply_lora, init_adapters, lora_spec, trainable_patterns
from scaletrain.models.loss import cross_entropy, logits_of
from scaletrain.models.params import (
    PROJECTION,
    base_name,
    canonical_name,
    copy_full,
    freeze_all_but,
    is_adapter,
    name_generator,
    seeded_init,
)

# Keys of a config's dict that say nothing about the tensors: left out of what a resume
# compares and of what rebuilds the model.
_VOLATILE = ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache", "_attn_implementation_autoset")
_SAFETENSORS_INDEX = "model.safetensors.index.json"


def transformers_module() -> Any:
    """transformers, offline and quiet (its warnings about unused generation fields would
    bury scaletrain's own lines)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise UserError(
            "model.source=hf needs the transformers package; accepted: pip install 'scaletrain[hf]', or model.source=builtin"
        ) from None
    transformers.logging.set_verbosity_error()
    return transformers


def load_config(path: str | None, inline: dict[str, Any] | None, vocab_size: int | None, where: str = "model") -> dict[str, Any]:
    """The model's config as a plain dict: read from `path`/config.json, or the inline one
    with the data's vocabulary size where it names none. Checked by transformers."""
    tf = transformers_module()
    if path is not None:
        d = Path(path).expanduser()
        accepted = "accepted: a local directory written by save_pretrained"
        if not (d / "config.json").is_file():
            raise UserError(f"{where}.path: {path!r} has no config.json; {accepted}")
        try:
            json.loads((d / "config.json").read_text(encoding="utf-8"))
            conf = tf.AutoConfig.from_pretrained(str(d), local_files_only=True)
        except (OSError, UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"{where}.path: {d / 'config.json'} is not a readable model config ({first}); {accepted}") from None
    else:
        raw = dict(inline or {})
        model_type = raw.pop("model_type", None)
        if model_type not in tf.CONFIG_MAPPING:
            raise UserError(
                f"{where}.hf_config.model_type {model_type!r} is unknown to transformers; accepted: e.g. llama, qwen2, gpt2, mistral"
            )
        if vocab_size is not None and "vocab_size" not in raw:
            raw["vocab_size"] = vocab_size
        try:
            conf = tf.AutoConfig.for_model(model_type, **raw)
        except (TypeError, ValueError) as e:
            raise UserError(
                f"{where}.hf_config: transformers refused it ({e}); accepted: the fields of a {model_type} config"
            ) from None
    if not any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in _causal_archs(tf, conf)):
        raise UserError(f"model_type {conf.model_type!r} has no causal language model class; accepted: decoder-only models")
    out = {k: v for k, v in conf.to_dict().items() if k not in _VOLATILE}
    return out


def _causal_archs(tf: Any, conf: Any) -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(conf.model_type)
    return [cls] if isinstance(cls, str) else list(cls or [])


@dataclass(frozen=True)
class HFSpec:
    """A Hugging Face causal LM; `hf_config` is its config as JSON (hashable), `path` the
    directory whose weights it starts from (None: seeded init)."""

    hf_config: str
    path: str | None = None
    name: str = "hf"
    loss_chunk_tokens: int = 0
    loss_compiled: bool = False  # train.compile: each chunk's loss one compiled kernel (models/loss.py)
    trainable: tuple[str, ...] = ()
    lora: LoraSpec | None = None

    @cached_property
    def _conf(self) -> Any:
        tf = transformers_module()
        raw = json.loads(self.hf_config)
        conf = tf.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
        conf.use_cache = False  # training: no key/value cache is built
        return conf

    @property
    def model_type(self) -> str:
        return str(self._conf.model_type)

    @property
    def vocab_size(self) -> int:
        return int(self._conf.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self._conf.hidden_size)

    @property
    def n_blocks(self) -> int:
        return int(self._conf.num_hidden_layers)

    @property
    def max_positions(self) -> int | None:
        return getattr(self._conf, "max_position_embeddings", None)

    @property
    def tied(self) -> bool:
        return bool(getattr(self._conf, "tie_word_embeddings", False))

    def _build(self, conf: Any) -> nn.Module:
        tf = transformers_module()
        # Parameters in torch's default dtype: fp32 for a run (the engines keep fp32 masters and
        # cast for compute themselves); the planner's traces set the regime's compute dtype (a
        # bf16 engine's block traced in fp32 priced its matmuls at fp32's rate: 10x the step).
        # sdpa: torch's fused attention, on every device.
        # A copy of the config: transformers keeps the one it is given as the model's own,
        # and a later build (the trainer's layout, a traced block) would set its attention
        # back on a model already built (cp_mode=ulysses sets its own, apply_cp).
        return tf.AutoModelForCausalLM.from_config(
            copy.deepcopy(conf), dtype=torch.get_default_dtype(), attn_implementation="sdpa"
        )

    def build_meta(self, max_seq_len: int) -> nn.Module:
        if self.max_positions is not None and max_seq_len > self.max_positions:
            raise UserError(
                f"data.seq_len={max_seq_len} exceeds the model's max_position_embeddings={self.max_positions}; "
                f"accepted: data.seq_len <= {self.max_positions}"
            )
        with torch.device("meta"):
            model = self._build(self._conf)
        if self.lora is not None:
            apply_lora(model, self.lora)
        freeze_all_but(model, trainable_patterns(self.trainable, self.lora))
        return model

    def blocks(self, model: nn.Module) -> nn.Module:
        return decoder_layers(model)

    def materialize(self, model: nn.Module, device: torch.device, seed: int) -> None:
        model.to_empty(device=device)
        if self.tied:
            model.tie_weights()  # type: ignore[operator]  # to_empty gave the head its own storage
        _init_buffers(model)
        std = float(getattr(self._conf, "initializer_range", 0.02))
        if self.path is not None:
            _load_weights(model, Path(self.path).expanduser(), seed, std)
        else:
            seeded_init(model, seed, std)
        if self.lora is not None:
            init_adapters(model, seed)

    def loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy(logits_of(output), targets, self.loss_chunk_tokens, self.loss_compiled)
        # A mixture of experts adds its router's load-balancing term exactly where
        # transformers adds it to the loss it computes from labels: when the model's config
        # sets output_router_logits (then the output holds aux_loss), weighted by its
        # router_aux_loss_coef. The model's own config decides, as in a transformers
        # fine-tune (MixtralConfig's default leaves it off): a run trains the objective the
        # model's config.json states, and a directory we export states ours. The term is
        # over this rank's micro-batch, as transformers computes it. As for the built-in
        # model's routers, only its gradient is added: the loss's value (the step rows'
        # `loss`) stays the cross entropy, comparable with the eval loss and a dense run's.
        aux = getattr(output, "aux_loss", None)
        if aux is None:
            return loss
        term = float(getattr(self._conf, "router_aux_loss_coef", 0.0)) * aux.to(loss.dtype)
        return loss + (term - term.detach())

    def config(self) -> dict[str, Any]:
        return {"source": "hf", "hf_config": json.loads(self.hf_config)} | ({"lora": self.lora.as_dict()} if self.lora else {})

    def counts(self) -> ModelCounts:
        return counts_of(self)

    def flops_per_token(self, seq_len: int) -> float:
        # As the built-in Llama's: 6 x matmul parameters plus attention scores and values; a
        # mixture of experts' stacked expert weights count for the top-k experts of the
        # layer's E that each token runs through (Mixtral's num_local_experts, Qwen's num_experts).
        c, counts = self._conf, self.counts()
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        experts, top_k = self.routed_experts()
        active = counts.experts * top_k / experts if experts and counts.experts else 0.0
        return float(6 * (counts.matmul + active) + 12 * c.num_hidden_layers * c.num_attention_heads * head_dim * seq_len)

    def routed_experts(self) -> tuple[int, int]:
        """(experts per MoE layer, experts per token) from the config; (0, 0) for a dense model."""
        c = self._conf
        experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 0
        return experts, (getattr(c, "num_experts_per_tok", 0) or 0) if experts else 0

    def traced_block(self, seq_len: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return _captured_block(self, seq_len), ()

    def traced_head(self) -> nn.Module:
        model = self._build(self._one_layer())
        norm = final_norm(model)
        head = model.get_output_embeddings()  # type: ignore[operator]
        return nn.Sequential(norm, head) if norm is not None else head

    def _one_layer(self) -> Any:
        conf = self._conf.__class__.from_dict(self._conf.to_dict())
        conf.num_hidden_layers = 1
        if getattr(conf, "layer_types", None):
            conf.layer_types = conf.layer_types[:1]
        return conf

    def export_config(self, dtype: str, eos: int | None) -> dict[str, Any]:
        """config.json for `ckpt export`: the model's own config, its causal-LM class, the
        exported dtype; the tokenizer's end-of-document id where the config names none."""
        tf = transformers_module()
        conf = json.loads(self.hf_config)
        torch_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
        ids = {k: conf.get(k) if conf.get(k) is not None else eos for k in ("bos_token_id", "eos_token_id")}
        return conf | ids | {"architectures": _causal_archs(tf, self._conf)[:1], "dtype": torch_dtype, "use_cache": True}

    def check_tp(self, tp: int) -> None:
        raise UserError(  # also refused with model.lora
            f"parallel.tp={tp} is not offered for Hugging Face models (no tensor-parallel plan is checked for them); "
            "accepted: parallel.tp=1 with fsdp or zero3, or the built-in model"
        )

    def apply_tp(self, model: nn.Module, mesh: Any, sequence_parallel: bool, loss_parallel: bool) -> None:
        self.check_tp(mesh.size())

    def check_ep(self, ep: int) -> None:
        if ep == 1:
            return
        c, (experts, _) = self._conf, self.routed_experts()
        if not experts:
            raise UserError(
                f"parallel.ep={ep} splits a mixture of experts' experts over ranks; model_type {c.model_type} has none "
                "(no num_local_experts or num_experts in its config); accepted: parallel.ep=1"
            )
        if experts % ep:
            accepted = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
            raise UserError(
                f"parallel.ep={ep} must divide model_type {c.model_type}'s {experts} experts per layer; accepted: "
                f"parallel.ep={accepted}"
            )

    def split_experts(self, model: nn.Module, ep_mesh: Any) -> list[nn.Module]:
        from scaletrain.models.hf_experts import split_stacked_experts

        return split_stacked_experts(model, ep_mesh, self._conf.model_type)

    def ulysses_problem(self, size: int) -> str | None:
        """Why Ulysses over `size` ranks does not run this model (None: it does); the planner
        asks too, so it offers only the sizes a run takes."""
        from scaletrain.models.ulysses import heads_problem

        c = self._conf
        problems = [
            heads_problem(c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads, size),
            "its attention dropout is not applied in a sliding window"
            if getattr(c, "sliding_window", None)
            and getattr(c, "use_sliding_window", True)
            and getattr(c, "attention_dropout", 0)
            else None,
            "its attention logits' soft cap is not split" if getattr(c, "attn_logit_softcapping", None) else None,
            "its routers' balance term is per rank" if getattr(c, "output_router_logits", False) else None,
        ]
        return next(filter(None, problems), None)

    def apply_cp(self, model: nn.Module, cp: Any) -> None:
        from scaletrain.models.ulysses import HF_ATTENTION, Ulysses, hf_attention

        c, key = self._conf, f"parallel.cp={cp.size}"
        if not isinstance(cp, Ulysses):
            raise UserError(
                f"{key} with cp_mode=allgather is not offered for Hugging Face models: their attention takes the whole "
                "sequence and cannot attend with one rank's chunks at their offsets; accepted: parallel.cp_mode=ulysses"
            )
        problem = self.ulysses_problem(cp.size)
        if problem:
            raise UserError(f"{key} with cp_mode=ulysses and model_type {c.model_type}: {problem}; accepted: parallel.cp=1")
        transformers_module().AttentionInterface.register(HF_ATTENTION, hf_attention(cp))
        for module in model.modules():  # the model's config (and a LoRA wrapper's view of it)
            if getattr(module, "config", None) is not None and hasattr(module.config, "_attn_implementation"):
                module.config._attn_implementation = HF_ATTENTION

        def local_positions(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # The whole sample in, this rank's positions through the model, rotated at their global positions.
            tokens = args[0] if args else kwargs.pop("input_ids")
            held = cp.positions(tokens.shape[1], tokens.device)
            kwargs |= {"input_ids": tokens[:, held], "position_ids": held.expand(tokens.shape[0], -1)}
            return args[1:], kwargs

        model.register_forward_pre_hook(local_positions, with_kwargs=True)

    def check_pp(self, pp: int) -> None:
        if pp > 1:
            raise UserError(
                f"parallel.pp={pp} is not offered for Hugging Face models (their forward cannot run one stage alone); "
                "accepted: parallel.pp=1, or the built-in model"
            )

    def pipeline_stage(self, model: nn.Module, blocks: range, first: bool, last: bool) -> None:
        self.check_pp(2)

    def stage_costs(self, seq_len: int) -> tuple[float, float, float]:
        c = self.counts()
        per_block = (self.flops_per_token(seq_len) - 6 * c.output) / max(self.n_blocks, 1)
        return 0.0, per_block, float(6 * (c.output or c.embedding))


def decoder_layers(model: nn.Module) -> nn.Module:
    """The ModuleList holding the model's decoder layers: the one whose children are the
    classes the model declares unsplittable, else the longest ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    for m in lists:
        if all(_unwrapped(c).__class__.__name__ in names for c in m.children()):
            return m
    if not lists:
        raise UserError(f"{type(model).__name__} has no list of repeated layers; accepted: decoder-only transformer models")
    return max(lists, key=len)


def _unwrapped(module: nn.Module) -> nn.Module:
    return getattr(module, "_checkpoint_wrapped_module", module)


def final_norm(model: nn.Module) -> nn.Module | None:
    """The base model's last norm (applied to the last layer's output before the head)."""
    base = getattr(model, str(model.base_model_prefix), model)
    norms = [
        m for n, m in base.named_children() if "norm" in type(m).__name__.lower() or n in ("norm", "ln_f", "final_layernorm")
    ]
    return norms[-1] if norms else None


def _init_buffers(model: nn.Module) -> None:
    """Recompute the buffers to_empty left uninitialized (rotary inverse frequencies): each
    module holding buffers but no parameters of its own goes through the model's
    `_init_weights`, the architecture's own rule for them."""
    for module in model.modules():
        if any(True for _ in module.buffers(recurse=False)) and not any(True for _ in module.parameters(recurse=False)):
            model._init_weights(module)  # type: ignore[operator]


@torch.no_grad()
def _load_weights(model: nn.Module, directory: Path, seed: int, std: float) -> None:
    """Each parameter from the directory's safetensors, one tensor at a time (a parameter
    saved in another layout: from its source tensors, converted)."""
    from safetensors import safe_open

    where = weight_files(directory)
    with ExitStack() as stack:
        files = {n: stack.enter_context(safe_open(str(directory / n), framework="pt")) for n in sorted(set(where.values()))}

        def read(key: str) -> torch.Tensor:
            return files[where[key]].get_tensor(key)

        names = {base_name(canonical_name(n)) for n, _ in model.named_parameters()}
        converted = _saved_layout(model, [k for k in where if k not in names], names)
        for name, param in model.named_parameters():
            name = base_name(canonical_name(name))
            if is_adapter(name):
                continue  # lora.init_adapters
            if name.startswith(PROJECTION + "."):  # distillation's projection is not the model's: seeded
                copy_full(param, torch.empty(param.shape).normal_(0.0, std, generator=name_generator(seed, name)))
                continue
            if name not in where and name not in converted:
                raise UserError(
                    f"model.path {str(directory)!r} has no weight {name!r}; accepted: a directory saved by save_pretrained "
                    f"for this architecture ({len(where)} tensors there, e.g. {next(iter(where))!r})"
                )
            full = read(name) if name in where else converted[name](read)
            if tuple(full.shape) != tuple(param.shape):
                raise UserError(
                    f"model.path: {name!r} has shape {tuple(full.shape)} there, the config makes {tuple(param.shape)}"
                )
            copy_full(param, full.to(param.dtype))


def _saved_layout(
    model: nn.Module, keys: list[str], names: set[str]
) -> dict[str, Callable[[Callable[[str], torch.Tensor]], torch.Tensor]]:
    """Parameters the directory holds in another layout -> how to build each from the
    tensors there (given a reader). save_pretrained writes a mixture of experts as one
    tensor per expert and projection (`experts.0.w1.weight`, the published checkpoints'
    layout) while transformers 5's model holds them stacked (`experts.gate_up_proj`):
    transformers' own conversion table for the architecture, which from_pretrained applies,
    maps the one to the other, so no architecture needs a case here. One parameter at a
    time: its source tensors are read, converted and dropped."""
    if not keys:
        return {}
    from copy import deepcopy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    mapping = get_model_conversion_mapping(model)  # type: ignore[arg-type]  # a PreTrainedModel, wrapped or not
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    wanted = dict.fromkeys(names, True)
    sources: dict[str, list[tuple[str, str | None]]] = {}
    for key in sorted(keys, key=dot_natural_key):  # experts in their order: 2 before 10
        target, pattern = rename_source_key(key, renamings, converters, str(model.base_model_prefix), wanted)
        if target in names:
            sources.setdefault(target, []).append((key, pattern))

    def build(target: str, found: list[tuple[str, str | None]]) -> Callable[[Callable[[str], torch.Tensor]], torch.Tensor]:
        def convert(read: Callable[[str], torch.Tensor]) -> torch.Tensor:
            if found[0][1] is None:  # renamed only
                return read(found[0][0])
            converter = deepcopy(by_pattern[found[0][1]])
            for key, pattern in found:
                # A callable where from_pretrained passes a Future: its synchronous loading
                # path, where the converter calls it when it converts (not before).
                converter.add_tensor(target, key, str(pattern), lambda key=key: read(key))  # type: ignore[arg-type]
            return converter.convert(target)[target]

        return convert

    return {target: build(target, found) for target, found in sources.items()}


def weight_files(directory: Path) -> dict[str, str]:
    """Tensor name -> file, from the index of a sharded save or the single file."""
    index = directory / _SAFETENSORS_INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single.name)
    raise UserError(
        f"model.path {str(directory)!r} holds no model.safetensors; accepted: safetensors weights (save_pretrained's default)"
    )


class _CapturedCall(CapturedCall):
    """A decoder layer called with the other arguments its model passed it."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with _fake_friendly_experts():
            return super().forward(hidden)


@contextmanager
def _fake_friendly_experts() -> Iterator[None]:
    """transformers' stacked experts multiply through torch's grouped_mm, whose fake-tensor
    kernel takes bf16 only while its CPU kernel takes fp32 too: the planner's trace of an
    fp32 block would fail. For the trace, transformers' own fallback runs instead (the same
    products one expert at a time, with a fake kernel for any dtype), which keeps the same
    tensors for backward as grouped_mm: the sorted token rows (the weights are parameters)."""
    from transformers.integrations import moe

    with mock.patch.object(moe, "_can_use_grouped_mm", lambda *args: False):
        yield


def _captured_block(spec: HFSpec, seq_len: int) -> nn.Module:
    """The first decoder layer of a one-layer copy, and what the model passes it for a
    [1, seq_len] batch (run under the caller's FakeTensorMode: nothing is allocated)."""
    model = spec._build(spec._one_layer())
    # Frozen as the run's model is (build_meta): a frozen weight's gradient is never computed,
    # and the trace prices what runs (LoRA's base was priced at its full backward: +68%). LoRA's
    # adapters themselves are left out (peft cannot swap layers under FakeTensorMode): rank-r
    # products beside each d x d one, ~r/d of its FLOPs.
    if spec.lora is not None:
        model.requires_grad_(False)  # the base: peft freezes all of it (model.trainable aside, a few norms)
    else:
        freeze_all_but(model, trainable_patterns(spec.trainable, None))
    with _masks_as_run():
        return first_call(model, next(decoder_layers(model).children()), seq_len, _CapturedCall)


@contextmanager
def _masks_as_run() -> Iterator[None]:
    """transformers builds no mask for SDPA where none is needed (no padding, one sequence per
    row: `is_causal=True`, FlashAttention's causal kernel). Whether the rows hold several packed
    sequences it reads from the position ids' values, which fake tensors do not have, so it
    assumed packing: the planner's trace got a whole mask and SDPA's masked kernel over the full
    square (twice the causal FLOPs: the HF path's attention priced at 2x). The capture's batch is
    what a run's is, one sequence at positions 0..T-1: no packing, as the run finds."""
    from transformers import masking_utils

    if not hasattr(masking_utils, "find_packed_sequence_indices"):  # a transformers without the detection
        yield
        return
    with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


def from_section(m: Any, vocab_size: int | None, lora: Any, document_eos: int | None, common: dict[str, Any]) -> HFSpec:
    """model.source=hf (config/sources.py): the model of a local directory or an inline config;
    its vocabulary at least the tokenizer's."""
    del document_eos  # its own attention mask and positions (the config refuses data.document_mask)
    conf = load_config(m.path, m.hf_config, vocab_size, m.where)
    if vocab_size is not None and conf["vocab_size"] < vocab_size:
        # A token id past the embedding table would fail at the first rare token, long after start-up.
        where = f"{m.where}.path {m.path!r}" if m.path else f"{m.where}.hf_config"
        raise UserError(
            f"{where} has vocab_size={conf['vocab_size']}, smaller than the data tokenizer's {vocab_size} tokens; accepted: "
            "the model's own tokenizer (data.tokenizer=<model dir>) or a model with a vocabulary at least that large"
        )
    return HFSpec(_canonical_json(conf), path=m.path, **{**common, "lora": lora_spec(lora, conf["model_type"])})


def from_saved(fields: dict[str, Any], adapters: LoraSpec | None) -> HFSpec:
    """A checkpoint's Hugging Face model: its config as trainer.json holds it (no directory needed)."""
    return HFSpec(_canonical_json(fields["hf_config"]), lora=adapters)


def _canonical_json(conf: dict[str, Any]) -> str:
    return json.dumps(conf, sort_keys=True, default=str)
