"""Copied into --work by scripts/peers/titan_llama.py as run_train.py: starts torchtitan.train.main (optionally on the CPU)."""

# ruff: noqa: E402  (the shims below must run before torchtitan is imported)
import json
import os
import sys

SHIMS = []  # what this file changed in torch or torchtitan: OUT.json's versions.compat_shims
if os.environ.get("ST_TITAN_CPU") == "1":
    # torchtitan 0.3.0 has no CPU path: its device type falls back to "cuda" when no accelerator
    # is found. These shims make it "cpu" (gloo) for the tiny plumbing check only.
    import types

    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    _cpu = torch.cpu
    _cpu.get_device_name = lambda *a, **k: "cpu"
    _cpu.get_device_properties = lambda *a, **k: types.SimpleNamespace(total_memory=64 * 2**30)
    _cpu.memory_stats = lambda *a, **k: {}
    _cpu.reset_peak_memory_stats = lambda *a, **k: None
    _cpu.empty_cache = lambda *a, **k: None
    _cpu.current_device = lambda: 0  # torch.cpu's returns "cpu", which c10d barrier() rejects
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        # What scaletrain's own compiles do (models/inductor.py): under ATen's portable kernels
        # inductor's vectorized C++ does not compile (its block masks are compiled); scalar code does.
        import torch._inductor.config

        torch._inductor.config.cpp.simdlen = 1
        SHIMS.append("cpu: ATEN_CPU_CAPABILITY=default: inductor's C++ scalar (cpp.simdlen=1)")

    import importlib.util

    if importlib.util.find_spec("triton") is None:
        # torch's CPU wheel has no Triton, and torchtitan.models.common imports it at module level
        # through the MoE expert-parallel token dispatcher (distributed/minimal_async_ep/kernels.py:
        # `import triton`, @triton.jit kernels), which a dense Llama-3 on one process never calls. A
        # stand-in for that one module (not for triton, which torch probes) whose kernels raise if used.
        def _no_triton(name):
            if name.startswith("_"):  # __file__, __path__, ...: what module walkers probe
                raise AttributeError(name)

            def kernel(*a, **k):
                raise NotImplementedError(f"minimal_async_ep.kernels.{name} needs Triton (absent from this torch)")

            return kernel

        _kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")
        _kernels.__getattr__ = _no_triton
        sys.modules[_kernels.__name__] = _kernels
        SHIMS.append("cpu: no Triton: torchtitan.distributed.minimal_async_ep.kernels stubbed (MoE expert parallel only)")

import dataclasses

import torch
import torch.distributed
import torch.distributed.fsdp

if os.environ.get("ST_TITAN_EMULATE_OLD_TORCH") == "1":
    # Test only: hide what torch 2.13 has and 2.11 lacks, to exercise the shims below.
    del torch.distributed.fsdp.DataParallelMeshDims
    SHIMS.append("emulating torch 2.11: DataParallelMeshDims hidden")

# torchtitan 0.3.0 targets a newer PyTorch than the device's 2.11. Two names it needs on the
# one-GPU llama3 path are missing there; neither changes what is computed:
# 1. torchtitan.distributed.fsdp / full_dtensor import torch.distributed.fsdp.DataParallelMeshDims
#    (new in torch 2.13) at module level. With one GPU, resolve_fsdp_mesh returns None for it and
#    fully_shard is never given dp_mesh_dims, so a stand-in class only satisfies the import.
if not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):

    @dataclasses.dataclass
    class DataParallelMeshDims:
        shard: object = None
        replicate: object = None

        def __post_init__(self):
            raise NotImplementedError("DataParallelMeshDims needs torch >= 2.13 (multi-GPU full_dtensor/spmd_types FSDP)")

    torch.distributed.fsdp.DataParallelMeshDims = DataParallelMeshDims
    SHIMS.append("torch.distributed.fsdp.DataParallelMeshDims = import-only stand-in")

# 3. its FlexAttention masks pass create_block_mask(separate_full_blocks=...), a keyword torch 2.13
#    added (the first H200 run failed there: "unexpected keyword argument"). True is what older
#    torch always does (full blocks apart from partial ones), False only for batch-invariant mode:
#    dropped where torch lacks it, before torchtitan imports the function by name.
import inspect

import torch.nn.attention.flex_attention as _flex

if "separate_full_blocks" not in inspect.signature(_flex.create_block_mask).parameters:
    _create_block_mask = _flex.create_block_mask

    def _without_separate_full_blocks(*args, separate_full_blocks=True, **kwargs):
        if not separate_full_blocks:
            raise NotImplementedError("separate_full_blocks=False (batch-invariant mode) needs torch >= 2.13")
        return _create_block_mask(*args, **kwargs)

    _flex.create_block_mask = _without_separate_full_blocks
    SHIMS.append("flex_attention.create_block_mask: separate_full_blocks dropped (torch < 2.13)")

# 2. after its first step Trainer.train() calls torch.distributed.set_timeout(timeout, group),
#    which torch 2.11 (and 2.13) lack; the same operation exists as distributed_c10d._set_pg_timeout.
import torchtitan

if not hasattr(torch.distributed, "set_timeout"):
    torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout
    SHIMS.append("torch.distributed.set_timeout = distributed_c10d._set_pg_timeout")

if os.environ.get("ST_TITAN_CPU") == "1":
    SHIMS.append("cpu: device type cpu, torch.cpu memory stubs, FlexAttention -> masked SDPA")
    # FlexAttention has no CPU backward: on the CPU only, attention runs as SDPA under the same
    # block-causal mask (dense, from the BlockMask's mask_mod).
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import AuxOutput, create_mask
    from torchtitan.models.common.attention import FlexAttention

    def _cpu_attn(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out, AuxOutput(lse=None, max_scores=None)

    FlexAttention._compiled_flex_attn = _cpu_attn

with open(os.environ["ST_TITAN_VERSIONS"], "w") as f:
    json.dump(
        {
            "torchtitan": torchtitan.__version__,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": sys.version.split()[0],
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "cuda_capability": torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None,
            "compat_shims": SHIMS,
        },
        f,
    )


def _dump_modules():
    # Which packages the run really imported, and from where (the carried wheels vs the image).
    mods = {}
    for name, m in list(sys.modules.items()):
        top = name.split(".")[0]
        if top in mods or top in sys.stdlib_module_names or top.startswith("_") or "." in name:
            continue
        mods[top] = os.path.dirname(getattr(m, "__file__", None) or "") or None
    with open(os.environ["ST_TITAN_MODULES"], "w") as f:
        json.dump(dict(sorted(mods.items())), f, indent=0)


import atexit

atexit.register(_dump_modules)

from torchtitan.train import main

main()
