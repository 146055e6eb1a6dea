"""Where train.float8 (torchao's float8 training of the blocks' Linear layers,
engines/float8.py) is offered. Without torch: config/schema.py asks `float8_problem` once the
whole config is known; a run asks `float8_device_problem` once it knows its device, and
engines/float8.py refuses a missing torchao with MISSING_EXTRA.
"""

from __future__ import annotations

from typing import Any

from scaletrain.config.sources import SOURCES
from scaletrain.strategies import TABLE, names_where, said

# Float8 matmuls (torch._scaled_mm) need NVIDIA compute capability 8.9 (Ada) or newer
# (Hopper 9.0, Blackwell 10.0): an A100 (8.0) has no float8 tensor cores.
MIN_CAPABILITY = (8, 9)
TORCHAO = "torchao==0.18.0"  # the float8 extra's pin (pyproject.toml): for messages
MISSING_EXTRA = f"train.float8=true needs torchao; accepted: pip install 'scaletrain[float8]' ({TORCHAO}), or train.float8=false"


def with_implied_precision(data: Any) -> Any:
    """The raw config with precision=bf16 where train.float8 is on and precision unset:
    float8 training is a bf16 run around its float8 matmuls (on a GPU bf16 is the default
    anyway, training/defaults.py; this makes `plan` and a CPU's error say the same)."""
    train = data.get("train") if isinstance(data, dict) else None
    if isinstance(train, dict) and str(train.get("float8")).lower() == "true" and "precision" not in data:
        return {**data, "precision": "bf16"}
    return data


def float8_problem(cfg: Any) -> str | None:
    """What in the config train.float8 does not go with (one line), or None."""
    if not cfg.train.float8:
        return None
    par, m = cfg.parallel, cfg.model
    # auto: the planner offers float8 layouts only (planning/float8.py `plannable`).
    if par.strategy != "auto" and (par.strategy not in TABLE or not TABLE[par.strategy].float8):
        where = said(names_where(lambda s: s.float8))
        why = TABLE[par.strategy].no_float8_why if par.strategy in TABLE else "not a strategy"
        return (
            f"train.float8=true is offered with parallel.strategy={where}, not {par.strategy} ({why}); accepted: "
            f"parallel.strategy={where.replace(' or ', '|')}, or train.float8=false"
        )
    if cfg.precision != "bf16":
        # torchao's float8 recipes (and torchtitan's runs of them) are bf16 runs: bf16 in and
        # out of each float8 matmul. fp32 would keep everything else 4 bytes wide for no
        # reason, fp16 would push its loss scale through the float8 casts: neither checked.
        return (
            f"train.float8=true runs the blocks' matmuls in float8 inside a bf16 run; precision={cfg.precision} is not "
            "offered (torchao's float8 training is bf16's); accepted: precision=bf16, or train.float8=false"
        )
    unchecked = [
        (par.tp > 1, f"parallel.tp={par.tp}", "parallel.tp=1", "torchao's float8 tensor-parallel styles are not wired"),
        (
            not SOURCES[m.source].float8,
            f"model.source={m.source}",
            "model.source=builtin",
            "which Linear is a router is not known",
        ),
        (m.lora is not None, "model.lora", "no model.lora", "a frozen float8 base under adapters is not checked"),
        (par.offload_params != "none", f"parallel.offload_params={par.offload_params}", "offload_params=none", "not checked"),
    ]
    for bad, given, accepted, why in unchecked:
        if bad:
            return f"train.float8=true does not combine with {given} ({why}); accepted: {accepted}, or train.float8=false"
    return None


def float8_device_problem(
    device_type: str, capability: tuple[int, int] | None, name: str, hip: bool = False, cpu_float8: bool = False
) -> str | None:
    """Whether a run's device can train in float8 (its type, CUDA compute capability, name);
    `cpu_float8`: this torch runs float8 matmuls on the CPU (torch._scaled_mm: torch 2.13 does,
    models/float8.py `cpu_float8_matmul` asks), slowly but exactly as a GPU rounds them, so a
    float8 configuration can be tried and tested before it meets one."""
    if device_type == "cpu" and cpu_float8:
        return None
    if device_type != "cuda":
        return (
            f"train.float8=true needs float8 matmuls: an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper), or "
            f"a CPU with a torch that runs torch._scaled_mm there (2.13 does); this run's device is {device_type} "
            f"(torch {_torch_version()}); accepted: train.float8=false, or such a device"
        )
    if hip:
        return f"train.float8=true is not checked on ROCm ({name}); accepted: train.float8=false, or an NVIDIA GPU"
    if capability is None or tuple(capability) < MIN_CAPABILITY:
        have = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return (
            f"train.float8=true needs float8 matmuls: NVIDIA compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            f"or newer (Ada 8.9, Hopper 9.0); {name} has {have}; accepted: train.float8=false, or such a GPU"
        )
    return None


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"
