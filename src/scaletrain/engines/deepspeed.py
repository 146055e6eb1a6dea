"""ZeRO stages 1/2/3 (with CPU/NVMe offload) through DeepSpeed's own engine.

DeepSpeed owns what it is good at: partitioning, its optimizers (FusedAdam, or
DeepSpeedCPUAdam when the optimizer is offloaded), mixed precision with its dynamic loss
scaler, gradient clipping and the checkpoint format. Everything it needs to know comes
from one JSON generated from our config (deepspeed_config.py), saved beside every
checkpoint. What stays ours: the lr schedule (set on the param groups every step) and when
an accumulation window ends (the trainer says so per micro-batch).
"""

from __future__ import annotations

import copy
import functools
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Callable
from contextlib import nullcontext, redirect_stdout
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletrain import disk_cache
from scaletrain.checkpoint.deepspeed_format import DEEPSPEED_TAG
from scaletrain.config import Config
from scaletrain.config.parallel import ParallelDims
from scaletrain.engines.base import AccumulationWindow, ParamGroups, StepStats, set_lr
from scaletrain.engines.block_wrappers import apply_activation_checkpointing, plain_name
from scaletrain.engines.context import long_sequences
from scaletrain.engines.deepspeed_config import build_deepspeed_config, to_json
from scaletrain.engines.deepspeed_ops import clear_stale_locks
from scaletrain.engines.teacher import frozen_meta, replicated_teacher, teacher_seed
from scaletrain.errors import UserError
from scaletrain.launch.distributed import World, ensure_process_group, uses_cuda
from scaletrain.models.spec import ModelSpec

CONFIG_FILE = "deepspeed_config.json"
TAG = DEEPSPEED_TAG


class DeepSpeedEngine(AccumulationWindow):
    format = "deepspeed"

    def __init__(
        self,
        spec: ModelSpec,
        world: World,
        dims: ParallelDims,
        cfg: Config,
        param_groups: ParamGroups,
        teacher: ModelSpec | None = None,
    ):
        self.name = cfg.parallel.strategy
        # DeepSpeed's data-parallel group is every rank: under parallel.cp its gradient
        # average then runs over dp x cp, each cp rank's loss the mean of its own tokens
        # (engines/context.py), and ZeRO partitions over the cp ranks too.
        self.dp_size = dims.dp_size * dims.cp
        self.device = world.device
        self.precision = cfg.precision
        self.save_frozen = cfg.checkpoint.frozen == "save"  # else checkpoints leave them out (checkpoint/frozen_base.py)
        # First, before anything slow: a conflicting deepspeed_extra key stops here.
        self.ds_config = build_deepspeed_config(cfg, dims.dp_size)
        self._config_json = to_json(self.ds_config)

        deepspeed = _import_deepspeed(world.device)
        if "nvme" in (cfg.parallel.offload_optimizer, cfg.parallel.offload_params):
            _require_async_io()
        ensure_process_group(world)
        # It adopts the existing group. It also print()s a line on every start (its shared-
        # memory comm op was loaded); stdout is our progress display, so that line goes.
        with open(os.devnull, "w") as sink, redirect_stdout(sink):
            deepspeed.init_distributed(dist_backend=dist.get_backend())
        if world.device.type == "cpu":
            _zero3_keeps_the_model_dtype_on_cpu()
            if cfg.precision == "fp16":
                _allow_fp16_on_cpu()

        model = spec.build_meta(cfg.data.seq_len)
        if cfg.parallel.activation_checkpointing:
            apply_activation_checkpointing(
                spec.blocks(model), cfg.parallel.ac_mode == "selective"
            )  # ZeRO-3 re-gathers on recompute
        spec.materialize(model, world.device, cfg.train.seed)  # the full model on every rank; ZeRO partitions it below
        self.module = model
        # DeepSpeed's optimizer takes the caller's groups; lr/betas/eps come from the JSON.
        # A copy of the config: DeepSpeed may normalise the dict it is given; the saved JSON
        # stays what we built.
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model), config=copy.deepcopy(self.ds_config)
        )
        self.model: nn.Module = self.ds  # forward through the engine: its hooks gather ZeRO-3 params
        if teacher is not None and self.name != "zero3":
            self.teacher = replicated_teacher(teacher, cfg.data.seq_len, world.device, cfg.train.seed, cfg.precision)
        elif teacher is not None:
            # ZeRO-3 partitions a model only inside an engine: one without an optimizer
            # (DeepSpeed's inference-only path) partitions the teacher as the student, and
            # its hooks gather each module for the forward. It casts to the 16-bit dtype itself.
            frozen = frozen_meta(teacher, cfg.data.seq_len)
            teacher.materialize(frozen, world.device, teacher_seed(cfg.train.seed))
            self.teacher, *_ = deepspeed.initialize(model=frozen, config=_forward_only(self.ds_config))
        teacher_module = getattr(self.teacher, "module", self.teacher)  # ZeRO-3's: inside its engine
        self.context, self.offload = long_sequences(world, dims, cfg, (spec, model), (teacher, teacher_module))

    def accumulate(self, boundary: bool) -> Any:
        # We own the accumulation window, not DeepSpeed's micro-step counter: the flag makes
        # ZeRO-1 reduce only on the boundary micro-batch (and ZeRO-2/3, which reduce-scatter
        # every micro-batch by design, finish their accumulation there).
        self.ds.set_gradient_accumulation_boundary(boundary)
        return nullcontext()

    def autocast(self) -> Any:
        # DeepSpeed owns precision: with fp16/bf16 it casts the module's parameters itself
        # and keeps fp32 master weights in its optimizer; autocast on top would double up.
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # The trainer already divided by the number of micro-batches; DeepSpeed's default
        # divides by gradient_accumulation_steps again. It still applies its loss scale.
        self.ds.backward(loss, scale_wrt_gas=False)

    def step(self, lr: float, across: Callable[[], bool] | None = None, limit: float | None = None) -> StepStats:
        # Replica groups and train.spikes take the torch engines only (config/ft.py, config/spikes.py).
        assert across is None and limit is None
        set_lr(self.optimizer, lr)
        self.ds.step()  # unscale, overflow check, clip, optimizer step, zero grads
        skipped = not self.ds.was_step_applied()
        # DeepSpeed's global norm (before clipping, after unscaling), summed over all ranks'
        # partitions; inf on an fp16 overflow step.
        norm = self.ds.get_global_grad_norm()
        grad_norm = torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32).detach()
        loss_scale = float(self.optimizer.loss_scale) if self.precision == "fp16" else None
        return StepStats(grad_norm.reshape(()), loss_scale, skipped)

    def save(self, path: Path, background: bool = False) -> None:
        # Always now, whatever `background` asks: DeepSpeed's decoupled writer commits
        # before the next optimizer step anyway (it would overlap one forward and
        # backward), and it switches the whole process to the spawn start method.
        path.mkdir(parents=True, exist_ok=True)
        # Collective: each rank writes its own partition of optimizer state (and, for
        # ZeRO-3, of the parameters); the fp32 master weights live in those files.
        # save_latest: rank 0 writes `latest` (the tag) beside the tag's directory, then all
        # ranks meet at a barrier, before our manifest hashes state/: DeepSpeed's own tools
        # (the zero_to_fp32.py copied into the tag's parent, tag=None loads) start from it.
        self.ds.save_checkpoint(str(path), tag=TAG, save_latest=True, exclude_frozen_parameters=not self.save_frozen)

    def load(self, path: Path) -> None:
        saved = _saved_world_size(path)
        if saved == 0:  # DeepSpeed itself would fail on an assert
            raise UserError(
                f"checkpoint {path.parent} holds no DeepSpeed ZeRO state (state/{TAG}/), so another engine wrote it; "
                "accepted: resuming it with the parallel.strategy that wrote it, or a new run.dir"
            )
        if saved != self.dp_size:
            raise UserError(
                f"checkpoint {path.parent} was written by DeepSpeed ZeRO on {saved} data-parallel ranks and resumes only on "
                f"{saved}, not {self.dp_size}; accepted: the same number of ranks, or a new run.dir"
            )
        if (path / TAG / "offloaded_tensors").is_dir():
            # DeepSpeed 0.19.8's load_checkpoint, for an optimizer swapped to NVMe, copies the
            # swapped files back and skips the rest of the ZeRO state (runtime/engine.py:4456:
            # no _load_zero_checkpoint, so no in-memory partitions, no parameters re-made
            # from the masters): measured, a resume at step 5 is off from step 6 on (loss
            # 5.56652 vs 5.56633, step 10 5.5357 vs 5.4619). Refused rather than trained wrong.
            raise UserError(
                f"checkpoint {path.parent} was written with parallel.offload_optimizer=nvme, which DeepSpeed 0.19.8 does not "
                "resume correctly (its load_checkpoint restores only the swapped files, not the rest of the ZeRO state); "
                "accepted: a new run.dir, or resuming checkpoints of runs with offload_optimizer cpu or none"
            )
        # load_from_fp32_weights (DeepSpeed's default) restores the exact fp32 master
        # partitions, so the resumed run continues bit-exactly.
        # Not strict where parameters are frozen: a checkpoint may leave them out (checkpoint.
        # frozen=reference), and they then stay as built, from the base. The trained ones
        # come from the fp32 partitions in the optimizer state either way.
        frozen = any(not p.requires_grad for p in self.module.parameters())
        loaded, _ = self.ds.load_checkpoint(
            str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False, load_module_strict=not frozen
        )
        if loaded is None:
            raise UserError(f"checkpoint {path.parent}: DeepSpeed could not load state/{TAG}/ (see its warning above)")
        _replay_cpu_adam_steps(self.ds.basic_optimizer)

    def extra_state(self) -> dict[str, Any]:
        # The loss scaler is saved inside DeepSpeed's own checkpoint; this copy is for people
        # reading trainer.json.
        if self.precision != "fp16":
            return {}
        return {"loss_scale": float(self.optimizer.loss_scale), "skipped_steps": int(self.ds.skipped_steps)}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        # DeepSpeed's own load_checkpoint restores its scaler; a checkpoint of a torch engine
        # (converted on resume) carries torch's GradScaler state: its scale carries over.
        scale = state.get("loss_scaler", {}).get("scale")
        if scale is not None and self.precision == "fp16":
            self.optimizer.loss_scaler.cur_scale = float(scale)

    def state_dict(self) -> dict[str, Any]:
        from deepspeed.utils import safe_get_full_optimizer_state

        # The fp32 masters and moments, assembled from every rank's partition (collective),
        # in the layout torch's get_state_dict gives (see engines.base.Engine.state_dict).
        model: dict[str, torch.Tensor] = {}
        optim: dict[str, Any] = {}
        stepped = self._link_optimizer_state(create=False)
        step = torch.tensor(float(_optimizer_step(self.ds.basic_optimizer)))
        first = self._first_names()
        for name, param in self._named_parameters():
            model[name] = self._full_value(param)
            if name in first and param.requires_grad:  # a frozen parameter has no optimizer state
                if stepped:  # as torch: no moments before the first step
                    for key in ("exp_avg", "exp_avg_sq"):
                        optim[f"state.{name}.{key}"] = safe_get_full_optimizer_state(param, key).detach().float().cpu().clone()
                    optim[f"state.{name}.step"] = step.clone()
                for key, value in self._group_settings(param).items():
                    optim[f"param_groups.{name}.{key}"] = value
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        params = dict(self._named_parameters())
        self._link_optimizer_state(create=True)
        # The forward's own copy (16-bit, or the fp32 module parameter at ZeRO-1/2) from the
        # full value; ZeRO-3 gathers it, and re-partitions rank 0's on leaving the context.
        with GatheredParameters(list({id(p): p for p in params.values()}.values()), modifier_rank=0):
            for name, param in params.items():
                if name in state["model"]:  # else frozen and left out of the checkpoint: as built
                    param.data.copy_(state["model"][name].to(param.dtype))
        first = self._first_names()
        for name, param in params.items():
            if name not in first or not param.requires_grad:  # frozen: its value is set above
                continue
            self._set_full(param, state["model"][name], None)
            group = self._group_of(param)
            for key in ("lr", "betas", "eps", "weight_decay"):
                group[key] = state["optim"].get(f"param_groups.{name}.{key}", group[key])
            for key in ("exp_avg", "exp_avg_sq"):
                self._set_full(param, state["optim"][f"state.{name}.{key}"], key)
        steps = {float(v) for k, v in state["optim"].items() if k.endswith(".step")}
        if len(steps) != 1:
            raise ValueError(f"DeepSpeed keeps one optimizer step for all parameters; the state holds {sorted(steps)}")
        _set_optimizer_step(self.ds.basic_optimizer, int(steps.pop()))
        _replay_cpu_adam_steps(self.ds.basic_optimizer)

    def _set_full(self, param: nn.Parameter, full: torch.Tensor, key: str | None) -> None:
        """Set the fp32 master (key None) or an Adam moment of `param` from its full value."""
        from deepspeed.utils import (
            safe_set_full_fp32_param,
            safe_set_full_optimizer_state,
            safe_set_local_fp32_param,
            safe_set_local_optimizer_state,
        )

        full = full.to(self.device)
        if not hasattr(param, "ds_tensor"):  # ZeRO-1/2
            safe_set_full_fp32_param(param, full) if key is None else safe_set_full_optimizer_state(param, full, key)
            return
        # ZeRO-3: this rank's own partition, cut here. DeepSpeed 0.19.8's full setter reads
        # past the end of the value on the last rank when the world size does not divide
        # the parameter's size (its partition is padded): start + length > numel.
        size = param.ds_tensor.numel()
        rank = self.optimizer._get_param_partition_rank(param)
        local = torch.zeros(size, dtype=full.dtype, device=self.device)
        piece = full.flatten()[rank * size : (rank + 1) * size]
        local[: piece.numel()] = piece
        safe_set_local_fp32_param(param, local) if key is None else safe_set_local_optimizer_state(param, local, key)

    def _link_optimizer_state(self, create: bool) -> bool:
        """Make every parameter's view of its optimizer state valid; False if there is none.

        DeepSpeed's optimizer state appears at the first step. DeepSpeed 0.19.8 then links
        each parameter to its slice of the state right after the first group has stepped,
        so the parameters of later groups stay linked to nothing (safe_get_full_optimizer_state
        raises): link again. `create` gives a fresh engine zero state to load into.
        """
        basic = self.ds.basic_optimizer
        # The fp32 partitions the optimizer steps (ZeRO-3 puts them into its groups only
        # for the length of a step).
        flat = getattr(self.optimizer, "single_partition_of_fp32_groups", None) or self.optimizer.fp32_partitioned_groups_flat
        if not all("exp_avg" in basic.state[p] for p in flat):
            if not create:
                return False
            for p in flat:
                basic.state[p].update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        if hasattr(self.optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 (stage 3 looks its state up)
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()
        return True

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter by plain name, a tied one under each of its names (as state_dict)."""
        return [(plain_name(n), p) for n, p in self.module.named_parameters(remove_duplicate=False)]

    def _first_names(self) -> set[str]:
        """The name the optimizer state goes under: a tied parameter's first name (as torch)."""
        return {plain_name(n) for n, _ in self.module.named_parameters()}

    def _group_of(self, param: nn.Parameter) -> dict[str, Any]:
        # DeepSpeed's optimizer groups hold flat partitions; its per-group lists of module
        # parameters say which group a parameter is in (bit16_groups: ZeRO-1/2, fp16_groups: 3).
        groups = getattr(self.optimizer, "bit16_groups", None) or self.optimizer.fp16_groups
        index = next(i for i, members in enumerate(groups) if any(p is param for p in members))
        return self.optimizer.param_groups[index]

    def _group_settings(self, param: nn.Parameter) -> dict[str, Any]:
        group = self._group_of(param)
        # torch AdamW's group keys, so that a torch engine loads these groups as they are.
        return {
            "lr": group["lr"],
            "betas": tuple(group["betas"]),
            "eps": group["eps"],
            "weight_decay": group["weight_decay"],
            **_TORCH_ADAMW_FLAGS,
        }

    def full_weights(self) -> dict[str, torch.Tensor]:
        # The fp32 master weights (not the fp16/bf16 copies the forward uses), assembled
        # from every rank's partition: a collective. Tied weights appear under each name,
        # like a state_dict.
        out: dict[str, torch.Tensor] = {}
        done: dict[int, torch.Tensor] = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            if id(param) not in done:
                done[id(param)] = self._full_value(param)
            out[plain_name(name)] = done[id(param)]
        return out

    def _full_value(self, param: nn.Parameter) -> torch.Tensor:
        """Collective: `param` whole on CPU in fp32: its fp32 master where the optimizer holds
        one; a frozen parameter (model.trainable) has none, so its own value, which ZeRO-3
        gathers from the partitions."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(param) if param.requires_grad else None
        if full is not None:
            return full.detach().float().cpu().clone()
        with GatheredParameters([param]):
            return param.detach().float().cpu().clone()

    def checkpoint_files(self) -> dict[str, str]:
        return {CONFIG_FILE: self._config_json}


# The AdamW group settings torch has and DeepSpeed does not: torch 2.13's defaults, but for
# `fused`, which the torch engines' AdamW is wherever torch has the kernel (optim.build_adamw).
_TORCH_ADAMW_FLAGS = {
    "amsgrad": False,
    "foreach": None,
    "maximize": False,
    "capturable": False,
    "differentiable": False,
    "fused": True,
    "decoupled_weight_decay": True,
}


def _optimizer_step(optimizer: Any) -> int:
    steps = {int(s["step"]) for s in optimizer.state.values() if "step" in s}
    return steps.pop() if len(steps) == 1 else 0


def _set_optimizer_step(optimizer: Any, step: int) -> None:
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = (
                type(state["step"])(step) if not isinstance(state["step"], torch.Tensor) else torch.full_like(state["step"], step)
            )


def preload(cfg: Config) -> None:
    """engines.preload: DeepSpeed's import at start-up, with the collector paused (launch/startup.py)."""
    _import_deepspeed(torch.device("cuda" if uses_cuda(cfg.run.device) else "cpu"))


def _import_deepspeed(device: torch.device) -> Any:
    # DeepSpeed picks its accelerator once, at import: on a CPU run it must be told, or it
    # looks for CUDA. setdefault: an explicit DS_ACCELERATOR from the user wins.
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # A build killed earlier would make this run's build of an op wait forever.
    if os.environ.get("LOCAL_RANK", "0") == "0":
        for lock in clear_stale_locks():
            print(f"scaletrain: removed {lock}, left by a DeepSpeed op build that was killed", file=sys.stderr)
    _skip_unneeded_start_costs()
    import deepspeed

    # Its INFO lines (config dumps, timers) would interleave with our progress output.
    deepspeed.utils.logger.setLevel(logging.WARNING)
    # DeepSpeed still calls collectives that this torch deprecates, once per bucket: a
    # warning per call the user can do nothing about.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )
    return deepspeed


def _skip_unneeded_start_costs() -> None:
    """Two things DeepSpeed 0.19.8 does at every start that a scaletrain run has no use for:
    ~4 s of one core per rank on a CPU run (cProfile, world 1, zero2: 14 s in all)."""
    # 1. ZeRO imports its Muon optimizer module (to list Muon as supported, and in its
    #    gradient reduction), whose kernels are decorated with torch.compile at import:
    #    that loads inductor, ~3 s. scaletrain never runs Muon (the optimizer section is
    #    ours; deepspeed_extra cannot change its type), so the module is imported once here
    #    with those decorators left eager. torch.compile is restored before anything else.
    muon = "deepspeed.runtime.zero.muon.original_muon"
    if muon not in sys.modules:
        compile_ = torch.compile
        torch.compile = _eager
        try:
            importlib.import_module(muon)
        finally:
            torch.compile = compile_
    # 2. Each CPU op load (shared-memory comm, FusedAdam, CPUAdam) asks py-cpuinfo twice for
    #    the CPU (-march, SIMD width), and py-cpuinfo answers from a new Python subprocess
    #    each time, ~1.1 s. The CPU does not change within a process (asked once) nor on a
    #    machine: its answer is kept on disk (disk_cache.py), keyed by what /proc/cpuinfo
    #    says of the CPU and by py-cpuinfo's version; only the machine's first rank asks.
    import cpuinfo

    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        ask = cpuinfo.get_cpu_info
        key = _cpu_key(cpuinfo.CPUINFO_VERSION_STRING)
        cpuinfo.get_cpu_info = functools.cache(lambda: ask() if key is None else disk_cache.cached(CPU_FILE, key, ask))


CPU_FILE = "cpuinfo"


def _cpu_key(version: str) -> list[str] | None:
    """py-cpuinfo's version and the CPU's identity (disk_cache.cpu_identity)."""
    cpu = disk_cache.cpu_identity()
    return None if cpu is None else [version, *cpu]


def _eager(model: Any = None, **_: Any) -> Any:
    """torch.compile's call forms (`compile(fn)`, `compile(**options)(fn)`), doing nothing."""
    return model if model is not None else (lambda fn: fn)


def _allow_fp16_on_cpu() -> None:
    # DeepSpeed's CPU accelerator reports fp16 as unsupported unless oneDNN has native fp16
    # kernels (AVX512-FP16/AMX-FP16), and refuses to start. torch computes fp16 correctly on
    # any CPU (slower, through fp32 inside its kernels), and DeepSpeed's loss scaler and
    # fp32 master weights do not depend on the device, so fp16 runs and is tested on CPU.
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        accelerator.is_fp16_supported = lambda: True


def _require_async_io() -> None:
    """NVMe offload swaps through DeepSpeed's async_io op, which links libaio: without it
    DeepSpeed fails deep inside initialize (or spends minutes in a JIT build first), so
    the missing library is named here, before any rank starts work."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible():
        raise UserError(
            "parallel.offload_optimizer/offload_params=nvme swap through DeepSpeed's async_io op, which needs libaio "
            "(its headers and library: Debian `apt-get install libaio-dev`, which `make setup-test` does as root); "
            "accepted: install it, or offload to cpu"
        )


def _zero3_keeps_the_model_dtype_on_cpu() -> None:
    """ZeRO-3 partitions the module in the dtype of its parameters, as on CUDA.

    DeepSpeed 0.19.8 (runtime/zero/partition_parameters.py:409, _set_dtype) reads
    `dtype or torch.float16 if accelerator.is_fp16_supported() else torch.bfloat16 if ...`,
    which Python groups as `(dtype or fp16) if fp16_supported else bf16`: the dtype ZeRO-3
    passes (the module's, runtime/zero/parameter_offload.py:167) is dropped wherever fp16
    is unsupported, as on DeepSpeed's CPU accelerator without AVX512-FP16. The partitioner
    then thinks an fp32 model is bf16, and with parallel.offload_params=nvme its parameter
    swapper (swap_tensor/partitioned_param_swapper.py) stores every swapped partition in
    bf16: an fp32 run loses 16 bits of each such weight (seen: step-1 loss off by 7e-6,
    step-4 by 9e-5 against the same run without offload). Honouring the given dtype is
    what CUDA gets from the same line; without one, DeepSpeed's own choice stands.
    """
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Init

    original = Init._set_dtype
    if getattr(original, "keeps_given_dtype", False):
        return

    def _set_dtype(self: Any, ds_config: Any, dtype: torch.dtype | None) -> None:
        original(self, ds_config, dtype)
        if dtype is not None:
            self.dtype = dtype

    _set_dtype.keeps_given_dtype = True  # type: ignore[attr-defined]
    Init._set_dtype = _set_dtype


def _replay_cpu_adam_steps(optimizer: Any) -> None:
    """Bring DeepSpeed's C++ CPU Adam to the state an uninterrupted run would have.

    DeepSpeedCPUAdam, and FusedAdam on the CPU accelerator, keep beta1**t and beta2**t
    inside the C++ optimizer and advance them by one multiplication per step; a fresh
    process resuming at step t gets std::pow(beta, t) instead, which differs in the last
    bits, and so would every update after a resume. Stepping the kernel 1..t over empty
    tensors repeats the uninterrupted run's multiplications exactly (nothing else changes).
    CUDA's FusedAdam derives the bias correction from the step on every call: nothing to do.
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    if not steps:
        return
    beta1, beta2 = optimizer.param_groups[0]["betas"]
    empty = torch.empty(0, dtype=torch.float32)
    if isinstance(optimizer, DeepSpeedCPUAdam):
        for t in range(1, max(steps) + 1):
            optimizer.ds_opt_adam.adam_update(optimizer.opt_id, t, 0.0, beta1, beta2, 1e-8, 0.0, True, empty, empty, empty, empty)
    elif isinstance(optimizer, FusedAdam) and get_accelerator().device_name() == "cpu":
        noop = torch.zeros(1, dtype=torch.int)
        for t in range(1, max(steps) + 1):
            optimizer.multi_tensor_adam(1, noop, [[empty]] * 4, 0.0, beta1, beta2, 1e-8, t, int(optimizer.adam_w_mode), 1, 0.0)


def _saved_world_size(path: Path) -> int:
    # One optimizer-state file per data-parallel rank; ZeRO partitions are tied to that count.
    return len(list((path / TAG).glob("*zero_pp_rank_*_optim_states.pt")))


def _forward_only(config: dict[str, Any]) -> dict[str, Any]:
    """The run's DeepSpeed config for a frozen model: the same stage, precision and
    parameter offload, nothing about optimizing it."""
    out = {k: copy.deepcopy(v) for k, v in config.items() if k not in ("optimizer", "gradient_clipping")}
    out["zero_optimization"].pop("offload_optimizer", None)
    return out


ENGINE = DeepSpeedEngine  # what engines.build_engine constructs for this module's strategies
