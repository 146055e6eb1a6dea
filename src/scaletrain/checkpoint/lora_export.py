"""Export a LoRA run's adapters in peft's own format: `adapter_model.safetensors` and
`adapter_config.json`, which `PeftModel.from_pretrained(base, DIR)` loads onto the base
model (the Hugging Face one the run started from, or the built-in model's HF export).

Tensor names are peft's saved form: `base_model.model.<module>.lora_A.weight` with the
module's Hugging Face name (the built-in model's `layers.0.attention.wq` becomes
`model.layers.0.self_attn.q_proj`) and without the adapter name ("default").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from scaletrain.checkpoint.formats import read_stamp
from scaletrain.checkpoint.hf_export import DTYPES, ExportTarget
from scaletrain.checkpoint.neutral import ParamLayout, WeightStream
from scaletrain.errors import UserError
from scaletrain.models.params import is_adapter


def export_adapter(ckpt: Path, out: Path, layout: ParamLayout, target: ExportTarget, dtype: str = "fp32") -> dict[str, Any]:
    from safetensors.torch import save_file

    if target.lora is None:
        raise UserError(f"checkpoint {ckpt} was not trained with model.lora; accepted: --lora merged (the default) or no --lora")
    if out.exists():
        raise UserError(f"{out} already exists; accepted: a path that does not exist yet (nothing is overwritten)")
    torch_dtype, _ = DTYPES[dtype]
    tensors, modules = {}, set()
    with WeightStream(ckpt, layout) as weights:
        for name in (n for n in layout.shapes if is_adapter(n)):
            module, rest = name.split(".lora_", 1)  # "<module>", "A.default.weight"
            hf_module = target.rename(f"{module}.weight").removesuffix(".weight")
            which = rest.split(".", 1)[0]
            tensors[f"base_model.model.{hf_module}.lora_{which}.weight"] = weights.get(name).to(torch_dtype).contiguous()
            modules.add(hf_module.rsplit(".", 1)[-1])
    lora = target.lora
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(modules),  # the Hugging Face names, whatever the run called them
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": None,
    }
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(out)  # whole or not at all
    return {"tensors": len(tensors), "engine": read_stamp(ckpt)["engine"]}
