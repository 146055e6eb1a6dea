"""The popular trainers on the same work as scaletrain, for `scaletrain bench --peers`:

    torchrun --nproc-per-node N -m scaletrain.bench.peers {hf-trainer|accelerate} RESOLVED.yaml RESULT.json [--liger]

The model is the Hugging Face Llama of the built-in model's exact shape (the config's
model section says so; runner.hf_model_of), built and initialised as scaletrain builds it,
so that scaletrain on the same model is the comparison. Each trainer is used as its
documentation shows, with its own defaults where the config has no say (HF Trainer's
optimizer implementation, Accelerate's data loader), and the same batch size,
accumulation, precision, learning-rate schedule, AdamW settings and clipping.

- hf-trainer: `Trainer` with `TrainingArguments`; for a ZeRO strategy the DeepSpeed JSON
  scaletrain generates is passed as `deepspeed=` (same engine settings; Trainer builds the
  engine through Accelerate).
  As its documentation recommends for speed: `torch_compile` where the config compiles,
  fused AdamW (`adamw_torch_fused`) on CUDA, `use_liger_kernel` with `--liger`; where the
  config has `model.lora`, PEFT's `LoraConfig` on the same modules (the base loaded in the
  run's precision, as PEFT's guides load it: frozen weights need no fp32 copy).
- accelerate: `Accelerator(gradient_accumulation_steps=...)`, `prepare`, `accumulate`,
  `backward`, `clip_grad_norm_`: its documented loop. DDP only.

The loss is the model's own (labels, already shifted: the same positions as scaletrain's).
Timing: the wall time between the trainer's own loss logging every train.log_every steps
(HF Trainer averages the loss over the ranks there: a collective and a host sync, as in
scaletrain's metrics), the first interval left out by the bench.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from scaletrain.bench.raw import adamw_groups, end_process, peak_bytes
from scaletrain.config import Config, load_config
from scaletrain.config.batch import global_batch
from scaletrain.data import PackedTokens, resolve_dataset_dir
from scaletrain.models import model_spec
from scaletrain.optim.schedule import lr_at
from scaletrain.strategies import strategy


class Windows(torch.utils.data.Dataset):
    """The prepared windows as HF causal-LM examples: inputs, and the targets already shifted."""

    def __init__(self, data: PackedTokens, n: int):
        self.data, self.n = data, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        w = torch.from_numpy(self.data.batch([i % self.data.samples_per_epoch])[0].astype("int64"))
        return {"input_ids": w[:-1], "labels": w[1:], "shift_labels": w[1:]}


def main(argv: list[str]) -> int:
    which, config_path, out, *flags = argv
    unknown = set(flags) - {"--liger"}
    if unknown or (flags and which != "hf-trainer"):
        raise SystemExit(f"peers: {' '.join(flags)} not accepted for {which}; accepted: --liger with hf-trainer")
    cfg = load_config([config_path])
    data = PackedTokens(resolve_dataset_dir(cfg.data)[0], cfg.data.seq_len, cfg.train.seed)
    # The base model: a LoRA config's adapters are the peer's own (PEFT, below), not scaletrain's.
    base = cfg if cfg.model.lora is None else cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": None})})
    spec = model_spec(base, data.vocab_size, data.eos_id)
    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    model = spec.build_meta(cfg.data.seq_len)
    spec.materialize(model, device, cfg.train.seed)  # scaletrain's initial weights
    world = int(os.environ.get("WORLD_SIZE", "1"))
    examples = Windows(data, cfg.train.steps * global_batch(cfg.train, world))
    counts: dict[str, int] = {}
    if which == "hf-trainer":
        intervals, losses = hf_trainer(cfg, model, examples, Path(out).parent, cuda, liger="--liger" in flags, counts=counts)
    else:
        intervals, losses = accelerate_loop(cfg, model, examples, Path(out).parent, cuda)
    peak = torch.tensor(float(peak_bytes(device)), device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    if int(os.environ.get("RANK", "0")) == 0:
        result = {"loop": which, "engine": cfg.parallel.strategy, "intervals": intervals, "losses": losses, **counts}
        Path(out).write_text(json.dumps(result | {"peak_bytes": int(peak.item()), "world_size": world}))
    return 0


def hf_trainer(
    cfg: Config, model: Any, examples: Windows, out: Path, cuda: bool, liger: bool = False, counts: dict[str, int] | None = None
) -> tuple[list[Any], list[Any]]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    t = cfg.train
    if cfg.model.lora is not None:
        model = peft_model(cfg, model)
    if counts is not None:  # what the peer trains: the same as scaletrain's run of this config
        counts["params"] = sum(p.numel() for p in model.parameters())
        counts["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ds = None
    if strategy(cfg.parallel.strategy).deepspeed_json:  # HF Trainer drives it through DeepSpeed
        from scaletrain.engines.deepspeed_config import build_deepspeed_config

        ds = build_deepspeed_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))

    class Clock(TrainerCallback):
        """The wall time between the Trainer's loss logs (each ends with the loss on the host)."""

        def __init__(self) -> None:
            self.since = time.perf_counter()
            self.intervals: list[list[float]] = []
            self.losses: list[list[float]] = []
            self.last = 0

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                now = time.perf_counter()
                self.intervals.append([state.global_step - self.last, now - self.since])
                self.losses.append([state.global_step, float(logs["loss"])])
                self.since, self.last = now, state.global_step

    args = TrainingArguments(
        output_dir=str(out / "hf"),
        per_device_train_batch_size=t.micro_batch,
        gradient_accumulation_steps=t.grad_accum,
        max_steps=t.steps,
        learning_rate=t.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio},
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_eps,
        max_grad_norm=t.clip_grad,
        bf16=cfg.precision == "bf16",
        fp16=cfg.precision == "fp16",
        logging_steps=t.log_every,
        save_strategy="no",
        report_to=[],
        seed=t.seed,
        use_cpu=not cuda,
        deepspeed=ds,
        remove_unused_columns=False,  # shift_labels goes to the model's loss
        disable_tqdm=True,
        dataloader_num_workers=0,
        torch_compile=t.compile,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        use_liger_kernel=liger,
    )
    clock = Clock()
    Trainer(model=model, args=args, train_dataset=examples, callbacks=[clock]).train()
    return clock.intervals, clock.losses


def peft_model(cfg: Config, model: Any) -> Any:
    """The model with PEFT's adapters on the config's LoRA modules, its base in the run's
    precision (bf16 or fp16: PEFT's guides load the base so; the adapters stay fp32)."""
    from peft import LoraConfig, get_peft_model

    lora = cfg.model.lora
    assert lora is not None
    if cfg.precision in ("bf16", "fp16"):
        model = model.to({"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.precision])
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=lora.target_modules or None, task_type="CAUSAL_LM")  # fmt: skip
    return get_peft_model(model, config)


def accelerate_loop(cfg: Config, model: Any, examples: Windows, out: Path, cuda: bool) -> tuple[list[Any], list[Any]]:
    from accelerate import Accelerator

    t = cfg.train
    acc = Accelerator(
        gradient_accumulation_steps=t.grad_accum,
        mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[cfg.precision],
        cpu=not cuda,
    )
    opt = torch.optim.AdamW(adamw_groups(model, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    # Not prepared: Accelerate's scheduler wrapper steps it once per process on every step
    # (its convention for schedules written in single-process steps), which would run the
    # cosine twice as fast on 2 ranks; stepped here once per optimizer step instead.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, t) / t.lr)
    loader = torch.utils.data.DataLoader(examples, batch_size=t.micro_batch, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    model.train()
    intervals, losses, window, step = [], [], [], 0
    since = time.perf_counter()
    for batch in loader:
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients and t.clip_grad > 0:
                acc.clip_grad_norm_(model.parameters(), t.clip_grad)
            opt.step()
            opt.zero_grad()
            if acc.sync_gradients:
                sched.step()
        window.append(loss.detach())
        if not acc.sync_gradients:
            continue
        step += 1
        if step % t.log_every == 0 or step == t.steps:
            values = acc.gather(torch.stack(window).mean()).mean().item()  # the loss on the host: a sync
            now = time.perf_counter()
            intervals.append([len(window) // t.grad_accum, now - since])
            losses.append([step, values])
            since, window = now, []
        if step == t.steps:
            break
    return intervals, losses


if __name__ == "__main__":
    # Without the interpreter's teardown, as the raw loops end (raw.end_process): Accelerate's
    # prepared DDP model outlived the process group there once and gloo aborted the rank
    # ("terminate called without an active exception", exit -6) after its results were written.
    end_process(main(sys.argv[1:]))
