"""Export a checkpoint as a Hugging Face model directory: safetensors shards + index,
config.json, generation_config.json and the run's tokenizer.

The built-in Llama becomes a LlamaForCausalLM: it uses rotate-half RoPE, HF Llama's
layout, so tensors are renamed, never permuted; its mixture of experts a MixtralForCausalLM
(checkpoint/hf_moe.py), each stacked expert weight written as one tensor per expert. A
Hugging Face model (model.source=hf) keeps its own names and config. Peak memory stays
near the largest tensor, not the model: each shard's header is computed from shapes
alone, then every tensor is read from the checkpoint (one DCP key, or one DeepSpeed
universal file), converted and appended to its shard, and dropped. The safetensors
format (an 8-byte little-endian header length, a JSON header of dtype, shape and byte
offsets, then the raw bytes) is written directly for that reason: the package's writer
needs every tensor of a file in memory at once. The package reads the result back
as the last step of every export, so a malformed file never leaves this module.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from scaletrain.checkpoint import hf_moe
from scaletrain.checkpoint.formats import read_stamp
from scaletrain.checkpoint.neutral import ParamLayout, WeightStream
from scaletrain.errors import UserError
from scaletrain.models.lora import LoraSpec, merge, merged_names
from scaletrain.models.presets import ModelShape, resolve_shape
from scaletrain.models.spec import ROUTING, LlamaSpec, ModelSpec

DTYPES = {"fp32": (torch.float32, "F32"), "bf16": (torch.bfloat16, "BF16"), "fp16": (torch.float16, "F16")}


def dtype_note(dtype: str) -> str:
    """How the summary line names the export's dtype. Checkpoints hold fp32 weights, and an
    export is bf16 unless asked otherwise (`ckpt export --dtype`): said each time, so a bf16
    export compared with the fp32 weights (off by up to 2^-9 relative) is not taken for a bad one."""
    if dtype == "fp32":
        return "fp32 (the checkpoint's weights exactly)"
    return f"{dtype}, rounded from the checkpoint's fp32 weights (--dtype fp32 keeps them exactly)"


_RENAMES = [
    (r"^tok_embeddings\.", "model.embed_tokens."),
    (r"^norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^layers\.(\d+)\.attention\.w([qkvo])\.", r"model.layers.\1.self_attn.\2_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w1\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w3\.", r"model.layers.\1.mlp.up_proj."),
    (r"^layers\.(\d+)\.feed_forward\.w2\.", r"model.layers.\1.mlp.down_proj."),
    (r"^layers\.(\d+)\.attention_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
]


def hf_name(name: str) -> str:
    for pattern, repl in _RENAMES:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    raise UserError(f"parameter {name!r} has no Hugging Face Llama name; accepted: checkpoints of the built-in Llama")


def hf_config(shape: ModelShape, max_positions: int, dtype: str, bos_eos: int | None) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_dim,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": shape.tie_embeddings,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
        "bos_token_id": bos_eos,
        "eos_token_id": bos_eos,
    }


@dataclass(frozen=True)
class ExportTarget:
    """What a checkpoint becomes: each tensor's HF name, config.json (from the dtype name
    and the tokenizer's end-of-document id) and whether the head is the embedding."""

    rename: Callable[[str], str]
    config: Callable[[str, int | None], dict[str, Any]]
    tied: bool
    lora: LoraSpec | None = None  # adapters to fold into their base weights
    # A checkpoint tensor written as several (name, shape) -> its pieces; None: as one, renamed.
    split: Callable[[str, torch.Size], list[hf_moe.Piece] | None] | None = None


def export_target(spec: ModelSpec, max_positions: int, model: Any = None) -> ExportTarget:
    """`model`: the checkpoint's config.yaml model section, for what a checkpoint's
    trainer.json leaves out as not shaping a tensor (a mixture's routing)."""
    if isinstance(spec, LlamaSpec):
        shape = spec.shape
        if shape.experts:
            return _mixtral_target(_with_routing(shape, model), max_positions, spec.lora)
        return ExportTarget(
            hf_name, lambda dtype, eos: hf_config(shape, max_positions, dtype, eos), shape.tie_embeddings, spec.lora
        )
    from scaletrain.models.hf import HFSpec
    from scaletrain.models.module_spec import PythonSpec

    if isinstance(spec, PythonSpec):
        # A model of your own: its state dict under its own names (a tied weight under each of them, as
        # load_state_dict wants it), and a config.json naming the spec that rebuilds it.
        return ExportTarget(lambda name: name, lambda dtype, eos: _python_config(spec, dtype, eos), tied=False)
    assert isinstance(spec, HFSpec)
    return ExportTarget(lambda name: name, spec.export_config, spec.tied, spec.lora)


def _python_config(spec: Any, dtype: str, eos: int | None) -> dict[str, Any]:
    dtypes = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    return {"scaletrain_model": spec.config(), "torch_dtype": dtypes[dtype], "eos_token_id": eos}


def _with_routing(shape: ModelShape, model: Any) -> ModelShape:
    """The saved shape with the routing fields of the run's config (top-k renormalization,
    capacity, scores, groups, balance): the checkpoint's model entry holds only tensor shapes."""
    if model is None or model.source != "builtin":
        return shape
    run = resolve_shape(model, shape.vocab_size)
    return replace(shape, **{k: getattr(run, k) for k in ROUTING})


def _mixtral_target(shape: ModelShape, max_positions: int, lora: LoraSpec | None) -> ExportTarget:
    hf_moe.check_expressible(shape)
    return ExportTarget(
        lambda name: hf_moe.mixtral_name(name) or hf_name(name),
        lambda dtype, eos: hf_moe.mixtral_config(hf_config(shape, max_positions, dtype, eos), shape),
        shape.tie_embeddings,
        lora,
        hf_moe.expert_pieces,
    )


def export_hf(
    ckpt: Path,
    out: Path,
    layout: ParamLayout,
    target: ExportTarget,
    dtype: str = "bf16",
    trainable_only: bool = False,
    tokenizer: Path | None = None,
    max_shard_bytes: int = 2 << 30,
    base: Callable[[], dict[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Write the HF directory `out` (must not exist); returns a summary for the CLI.
    `base` builds the base model's weights, for a checkpoint that left its frozen
    parameters out (checkpoint/frozen_base.py); called once, only if such a tensor is exported."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype} is invalid; accepted: {', '.join(DTYPES)}")
    if out.exists():
        raise UserError(f"{out} already exists; accepted: a path that does not exist yet (nothing is overwritten)")
    torch_dtype, st_dtype = DTYPES[dtype]
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with WeightStream(ckpt, layout) as weights:
        names = [n for n in layout.shapes if not (target.tied and n in layout.aliases)]
        if trainable_only:
            if target.lora is not None:
                raise UserError("--trainable-only of a LoRA run: its trained tensors are the adapters; accepted: --lora adapter")
            names = [n for n in names if layout.aliases.get(n, n) in weights.trained]
            if not names:
                raise UserError(f"checkpoint {ckpt} holds no optimizer state, so no parameter is known to be trained")
        # Each exported name -> the checkpoint tensor it is read from, and the LoRA pair
        # folded into it (W + alpha/r * B @ A): the merged model has no adapters left.
        sources = merged_names(names) if target.lora else {n: (n, None) for n in names}
        shapes = {out: layout.shapes[src] for out, (src, _) in sources.items()}
        built: dict[str, torch.Tensor] = {}

        def tensor(name: str) -> torch.Tensor:
            if weights.holds(name):
                return weights.get(name)
            if base is None:
                raise UserError(f"checkpoint {ckpt} holds no weights for {name}; accepted: a checkpoint of this model")
            if not built:
                built.update(base())
            return built[layout.aliases.get(name, name)].float()

        def value(out: str) -> torch.Tensor:
            src, pair = sources[out]
            if pair is None or target.lora is None:
                return tensor(src)
            return merge(tensor(src), tensor(pair[0]), tensor(pair[1]), target.lora)

        # Each Hugging Face tensor -> the exported tensor it is (part of). A tensor split in
        # pieces is read once: its pieces follow each other, and the last one read is kept.
        pieces: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {}
        hf_shapes: dict[str, torch.Size] = {}
        for name in sources:
            split = target.split(name, shapes[name]) if target.split else None
            for hf, shape, take in split or [(target.rename(name), shapes[name], _whole)]:
                pieces[hf], hf_shapes[hf] = (name, take), shape
        last: dict[str, torch.Tensor] = {}

        def piece(hf: str) -> torch.Tensor:
            name, take = pieces[hf]
            if name not in last:
                last.clear()  # before reading the next: one full tensor in memory
                last[name] = value(name)
            return take(last[name])

        shards = _plan_shards(list(pieces), hf_shapes, torch_dtype, max_shard_bytes)
        weight_map: dict[str, str] = {}
        total = 0
        for i, shard in enumerate(shards):
            file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            total += _write_shard(tmp / file, shard, hf_shapes, piece, torch_dtype, st_dtype)
            weight_map |= dict.fromkeys(shard, file)
        last.clear()
    index = {"metadata": {"total_size": total, "format": "pt"}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    eos = _write_tokenizer(tmp, tokenizer) if tokenizer else None
    config = target.config(dtype, eos)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config.get(k) for k in ("bos_token_id", "eos_token_id")}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _check_readable(tmp, weight_map)
    tmp.rename(out)  # whole or not at all
    stamp = read_stamp(ckpt)
    return {"tensors": len(weight_map), "bytes": total, "files": len(shards), "engine": stamp["engine"]}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _plan_shards(names: list[str], shapes: dict[str, torch.Size], dtype: torch.dtype, limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name in names:
        nbytes = shapes[name].numel() * itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_shard(
    path: Path,
    names: list[str],
    shapes: dict[str, torch.Size],
    value: Callable[[str], torch.Tensor],
    dtype: torch.dtype,
    st_dtype: str,
) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        nbytes = shapes[name].numel() * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:  # one tensor in memory at a time
            tensor = value(name).to(dtype).contiguous()
            f.write(tensor.view(torch.uint8).numpy().data)  # the tensor's own bytes, no copy
            del tensor
    return offset


def _write_tokenizer(out: Path, tokenizer: Path) -> int | None:
    """Copy the run's tokenizer.json and say how transformers should load it; returns the
    end-of-document token id."""
    from tokenizers import Tokenizer

    from scaletrain.data.prepare import EOS_CANDIDATES

    shutil.copyfile(tokenizer, out / "tokenizer.json")
    tok = Tokenizer.from_file(str(tokenizer))
    eos = next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}
    if eos:
        config |= {"eos_token": eos, "bos_token": eos}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.token_to_id(eos) if eos else None


def _check_readable(out: Path, weight_map: dict[str, str]) -> None:
    from safetensors import safe_open

    for file in sorted(set(weight_map.values())):
        with safe_open(str(out / file), framework="pt") as f:
            want = sorted(n for n, shard in weight_map.items() if shard == file)
            if sorted(f.keys()) != want:
                raise RuntimeError(f"{file}: safetensors reads {len(list(f.keys()))} tensors, {len(want)} were written")


def export_checkpoint(
    ckpt: Path,
    out: Path,
    dtype: str = "bf16",
    trainable_only: bool = False,
    tokenizer: Path | None = None,
    max_shard_bytes: int = 2 << 30,
) -> dict[str, Any]:
    """A complete checkpoint directory -> the Hugging Face directory `out`, everything taken
    from the checkpoint itself (its config.yaml and trainer state): what `ckpt export` and
    checkpoint.hf_every (training/saves.py) both write. A checkpoint without its frozen
    parameters gets them from its base, rebuilt on the CPU; a LoRA run's adapters are folded in."""
    from scaletrain.checkpoint.frozen_base import base_weights, check_base
    from scaletrain.checkpoint.state import TrainerState
    from scaletrain.config import load_config
    from scaletrain.models import saved_spec

    saved = TrainerState.read(ckpt)
    cfg = load_config([str(ckpt / "config.yaml")])
    spec = saved_spec(saved.model)
    layout = ParamLayout(spec.build_meta(cfg.data.seq_len))
    ref = saved.base
    if ref is not None and not trainable_only:
        check_base(ckpt, ref, cfg)
    done = export_hf(
        ckpt,
        out,
        layout,
        export_target(spec, max_positions=cfg.data.seq_len, model=cfg.model),
        dtype=dtype,
        trainable_only=trainable_only,
        tokenizer=tokenizer,
        max_shard_bytes=max_shard_bytes,
        base=(lambda: base_weights(cfg, spec)) if ref is not None else None,
    )
    return {**done, "step": saved.step}
