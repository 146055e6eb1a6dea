"""The hand-written loops `scaletrain bench` measures scaletrain's own against: what a
competent user writes from each engine's tutorial, and nothing of scaletrain's loop.

    torchrun --nproc-per-node N -m scaletrain.bench.raw RESOLVED.yaml RESULT.json

One loop per engine family, over the real engine exactly as its tutorial drives it:
- ddp: `DistributedDataParallel(model)` (from world size 2), `no_sync` on all but the last
  micro-batch, `torch.autocast` for bf16 / fp16 and a `GradScaler` for fp16, AdamW.
- fsdp: `fully_shard` on every block and then on the root (torch's defaults otherwise),
  `MixedPrecisionPolicy` for bf16 / fp16, `set_requires_gradient_sync` while accumulating.
- zero1/2/3: `deepspeed.initialize` with the DeepSpeed JSON scaletrain generates for the
  same config (the engine's settings are the same; only the loop differs), then
  `engine.backward` / `engine.step` after every micro-batch, as DeepSpeed's tutorial does.

What is shared with scaletrain's run, so that the work is equal and the numbers compare:
the resolved config (its values, not its code paths), the model (the same spec builds and
initialises the same weights from the same seed) and the batches (the same prepared
tokens read through the same memory-mapped index: a few microseconds a step). The losses
of the two loops therefore agree step for step, which `scaletrain bench` checks.

Timing, as scaletrain's metrics do it: every `train.log_every` steps the losses of the
interval are averaged over the ranks (a collective and a host sync, which scaletrain's
flush also pays), and the wall time since the previous one is one interval.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletrain.config import Config, load_config
from scaletrain.data import PackedTokens, RankBatches, resolve_dataset_dir
from scaletrain.launch.env import use_build_environment
from scaletrain.models import model_spec
from scaletrain.optim.schedule import lr_at
from scaletrain.strategies import strategy

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: list[str]) -> int:
    config_path, out = argv
    use_build_environment()  # DeepSpeed's ops from the environment's cache, as the engines use them
    cfg = load_config([config_path])
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)

    data = PackedTokens(resolve_dataset_dir(cfg.data)[0], cfg.data.seq_len, cfg.train.seed)
    batches = RankBatches(data, cfg.train.micro_batch, cfg.train.grad_accum, rank, world_size)
    spec = model_spec(cfg, data.vocab_size, data.eos_id)
    loop = LOOPS[strategy(cfg.parallel.strategy).engine](spec, cfg, device, world_size)

    intervals, losses, window = [], [], []
    since = time.perf_counter()
    for step in range(cfg.train.steps):
        micro = [(x.to(device), y.to(device)) for x, y in batches.next_step()]
        window.append(loop.train_step(micro, lr_at(step, cfg.train)))
        if (step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.train.steps:
            mean = torch.stack(window)
            dist.all_reduce(mean)
            values = (mean / world_size).tolist()  # the host waits for the interval's work here
            now = time.perf_counter()
            intervals.append([len(window), now - since])
            losses += [[step + 2 - len(values) + i, v] for i, v in enumerate(values)]
            since, window = now, []

    peak = torch.tensor(float(peak_bytes(device)), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        result = {"loop": "raw", "engine": cfg.parallel.strategy, "intervals": intervals, "losses": losses}
        Path(out).write_text(json.dumps(result | {"peak_bytes": int(peak.item()), "world_size": world_size}))
    dist.destroy_process_group()
    return 0


def peak_bytes(device: torch.device) -> int:
    """CUDA: the most ever allocated; CPU: the process's peak resident set (as scaletrain's metrics)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def adamw_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's groups: decay on matrices, none on gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


class DDPLoop:
    def __init__(self, spec: Any, cfg: Config, device: torch.device, world_size: int):
        model = spec.build_meta(cfg.data.seq_len)
        spec.materialize(model, device, cfg.train.seed)
        autocast = torch.autocast(device.type, dtype=LOW[cfg.precision]) if cfg.precision in LOW else nullcontext()
        self.setup(wrap_ddp(model, device, world_size), spec, cfg, device, autocast)

    def setup(self, model: nn.Module, spec: Any, cfg: Config, device: torch.device, autocast: Any) -> None:
        """AdamW (fused on CUDA, as scaletrain), fp16's GradScaler, the model's own loss."""
        t = cfg.train
        self.model, self.autocast, self.loss, self.clip = model, autocast, spec.loss, t.clip_grad
        self.opt = torch.optim.AdamW(
            adamw_groups(model, t.weight_decay),
            lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps,
            fused=device.type == "cuda" or None,
        )
        self.scaler = torch.amp.GradScaler(device.type, init_scale=t.loss_scale_init) if cfg.precision == "fp16" else None

    def sync(self, last: bool) -> Any:
        return nullcontext() if last or not isinstance(self.model, nn.parallel.DistributedDataParallel) else self.model.no_sync()

    def train_step(self, micro: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> torch.Tensor:
        for group in self.opt.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=micro[0][0].device)
        for i, (x, y) in enumerate(micro):
            with self.sync(i == len(micro) - 1):
                with self.autocast:
                    loss = self.loss(self.model(x), y) / len(micro)
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.opt)
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total


def wrap_ddp(model: nn.Module, device: torch.device, world_size: int) -> nn.Module:
    if world_size == 1:  # as scaletrain: nothing to reduce with one rank
        return model
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


class FSDPLoop(DDPLoop):
    def __init__(self, spec: Any, cfg: Config, device: torch.device, world_size: int):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (
            MixedPrecisionPolicy(param_dtype=LOW[cfg.precision], reduce_dtype=torch.float32) if cfg.precision in LOW else None
        )
        model = spec.build_meta(cfg.data.seq_len)
        for block in spec.blocks(model).children():
            fully_shard(block, mp_policy=policy or MixedPrecisionPolicy())
        fully_shard(model, mp_policy=policy or MixedPrecisionPolicy())
        spec.materialize(model, device, cfg.train.seed)
        self.setup(model, spec, cfg, device, nullcontext())  # no autocast: the policy casts

    def sync(self, last: bool) -> Any:
        self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return nullcontext()


class DeepSpeedLoop:
    def __init__(self, spec: Any, cfg: Config, device: torch.device, world_size: int):
        import deepspeed

        from scaletrain.engines.deepspeed import _allow_fp16_on_cpu
        from scaletrain.engines.deepspeed_config import build_deepspeed_config

        deepspeed.init_distributed(dist_backend=dist.get_backend())
        if cfg.precision == "fp16" and device.type == "cpu":
            _allow_fp16_on_cpu()  # DeepSpeed's CPU accelerator refuses fp16 otherwise
        model = spec.build_meta(cfg.data.seq_len)
        spec.materialize(model, device, cfg.train.seed)
        self.engine, self.opt, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=adamw_groups(model, cfg.train.weight_decay),
            config=build_deepspeed_config(cfg, world_size),
        )
        self.loss = spec.loss

    def train_step(self, micro: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> torch.Tensor:
        for group in self.opt.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=micro[0][0].device)
        for x, y in micro:
            loss = self.loss(self.engine(x), y)
            self.engine.backward(loss)  # divided by gradient_accumulation_steps inside
            self.engine.step()  # applied at the accumulation boundary only
            total += loss.detach() / len(micro)
        return total


# One loop per engine (the table row's `engine`: the module of scaletrain.engines that runs the strategy).
LOOPS: dict[str, type[DDPLoop] | type[DeepSpeedLoop]] = {"ddp": DDPLoop, "fsdp": FSDPLoop, "deepspeed": DeepSpeedLoop}


def end_process(code: int) -> None:
    """Exit as scaletrain's own processes do (cli._end_process), without the interpreter's
    teardown of torch: there, at times, a thread of the destroyed process group is still
    joinable and the rank aborts ("terminate called without an active exception") after
    its work was done and written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
