"""The popular trainers on the same work as scaletrain, for `scaletrain bench --peers`:

    torchrun --nproc-per-node N -m scaletrain.bench.peers {hf-trainer|accelerate} RESOLVED.yaml RESULT.json

The model is the Hugging Face Llama of the built-in model's exact shape (the config's
model section says so; runner.hf_model_of), built and initialised as scaletrain builds it,
so that scaletrain on the same model is the comparison. Each trainer is used as its
documentation shows, with its own defaults where the config has no say (HF Trainer's
optimizer implementation, Accelerate's data loader), and the same batch size,
accumulation, precision, learning-rate schedule, AdamW settings and clipping.

- hf-trainer: `Trainer` with `TrainingArguments`; for a ZeRO strategy the DeepSpeed JSON
  scaletrain generates is passed as `deepspeed=` (same engine settings; Trainer builds the
  engine through Accelerate).
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
    which, config_path, out = argv
    cfg = load_config([config_path])
    data = PackedTokens(resolve_dataset_dir(cfg.data)[0], cfg.data.seq_len, cfg.train.seed)
    spec = model_spec(cfg, data.vocab_size, data.eos_id)
    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    model = spec.build_meta(cfg.data.seq_len)
    spec.materialize(model, device, cfg.train.seed)  # scaletrain's initial weights
    world = int(os.environ.get("WORLD_SIZE", "1"))
    examples = Windows(data, cfg.train.steps * global_batch(cfg.train, world))
    run = hf_trainer if which == "hf-trainer" else accelerate_loop
    intervals, losses = run(cfg, model, examples, Path(out).parent, cuda)
    peak = torch.tensor(float(peak_bytes(device)), device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    if int(os.environ.get("RANK", "0")) == 0:
        result = {"loop": which, "engine": cfg.parallel.strategy, "intervals": intervals, "losses": losses}
        Path(out).write_text(json.dumps(result | {"peak_bytes": int(peak.item()), "world_size": world}))
    return 0


def hf_trainer(cfg: Config, model: Any, examples: Windows, out: Path, cuda: bool) -> tuple[list[Any], list[Any]]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    t = cfg.train
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
    )
    clock = Clock()
    Trainer(model=model, args=args, train_dataset=examples, callbacks=[clock]).train()
    return clock.intervals, clock.losses


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
