"""`scaletrain eval RUN_OR_CHECKPOINT [key=value ...]`: the eval loss of a checkpoint, and
its downstream tasks' accuracy with eval.tasks (training/tasks.py).

The checkpoint's own config (its config.yaml) with the overrides applied says what to
evaluate on (the eval section) and how to run (parallel.*, run.device, precision); the
engine is built at this world size and loads the checkpoint as a resume does (natively,
resharded, or converted from another engine and verified: checkpoint/restore.py). The
eval set is the one training used: the same windows of the same global batch, so the
loss equals the run's eval row of that step at any world size and engine (training/evaluation.py).

eval.split may be lowered, never raised: a document is held out when its hash falls below
the fraction, so a smaller split holds out a subset of what training skipped, a larger
one documents the run trained on.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import torch

from scaletrain import checkpoint
from scaletrain.checkpoint.neutral import ParamLayout
from scaletrain.checkpoint.state import FILE
from scaletrain.config import Config, load_config
from scaletrain.config.batch import per_rank, settle
from scaletrain.config.parallel import dims_for
from scaletrain.data import MANIFEST, PackedTokens, open_mix, resolve_dataset_dir
from scaletrain.data.remote import store_options
from scaletrain.engines import build_engine
from scaletrain.errors import UserError
from scaletrain.launch.distributed import World, init_distributed, shutdown
from scaletrain.models import model_spec
from scaletrain.models.moe import attach_expert_bias
from scaletrain.optim.optimizers import decay_groups
from scaletrain.telemetry.progress import task_line
from scaletrain.training.evaluation import eval_loss, evaluate, open_eval_set
from scaletrain.training.tasks import evaluate_tasks, open_tasks


def newest_checkpoint(target: str) -> Path:
    """A step directory as given, or a run directory's (or its checkpoints/') newest complete one."""
    path = Path(target)
    if (path / FILE).is_file():
        if not checkpoint.is_complete(path):
            raise UserError(f"checkpoint {path} is incomplete (no {checkpoint.MARKER} marker); accepted: a complete one")
        return path
    found = checkpoint.latest_complete(path / "checkpoints" if (path / "checkpoints").is_dir() else path)
    if found is None:
        raise UserError(
            f"{target}: no complete checkpoint found; accepted: a run directory holding one, or a checkpoints/step_<N> directory"
        )
    return found


def checkpoint_config(ckpt: Path, overrides: list[str]) -> Config:
    """The checkpoint's config with `overrides`; eval.split only lowered (module doc)."""
    saved = load_config([str(ckpt / "config.yaml")])
    # One of eval.data and eval.split given replaces the other the run had: another corpus
    # (what training held out then does not matter), or held-out documents instead.
    given = {o.partition("=")[0].strip() for o in overrides}
    if "eval.data" in given and "eval.split" not in given:
        overrides = [*overrides, "eval.split=0"]
    if "eval.split" in given and "eval.data" not in given:
        overrides = [*overrides, "eval.data=[]"]
    cfg = load_config([str(ckpt / "config.yaml")], overrides)
    trained = saved.eval.held_out
    if cfg.eval.held_out > trained and not cfg.eval.data:
        raise UserError(
            f"eval.split={cfg.eval.held_out:g}: {ckpt} was trained with eval.split={trained:g}, and a larger split holds "
            f"out documents it trained on; accepted: eval.split <= {trained:g}, or eval.data=PATHS"
        )
    return cfg


OWN = ("eval.data=train", "eval.data=[train]")


def own_training_data(ckpt: Path, overrides: list[str]) -> tuple[list[str], bool]:
    """`eval.data=train`: the run's own training documents (its prepared dataset) as eval.data,
    for a run trained without a held-out split; the overrides then, and whether it was asked."""
    if not any(o.replace(" ", "") in OWN for o in overrides):
        return overrides, False
    saved = load_config([str(ckpt / "config.yaml")])
    if saved.data.mix:
        raise UserError("eval.data=train takes a run of one dataset (data.paths), not data.mix; accepted: eval.data=PATHS")
    prepared, _ = resolve_dataset_dir(saved.data)
    rest = [o for o in overrides if o.replace(" ", "") not in OWN]
    return [*rest, f"eval.data={prepared}"], True


def evaluate_checkpoint(target: str, overrides: list[str], say: bool = True) -> dict[str, Any]:
    """Collective over the launched ranks: the eval figures of the checkpoint `target`; rank 0
    prints them (unless not `say`: scaletrain.evaluate returns them only)."""
    ckpt = newest_checkpoint(target)
    overrides, own = own_training_data(ckpt, overrides)
    cfg = checkpoint_config(ckpt, overrides)
    world = init_distributed(cfg.run.device, cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        row = _evaluate(ckpt, cfg, world)
    finally:
        gc.collect()  # the engine before the process group (trainer.train says why)
        shutdown(world)
    if world.is_main and say:
        print(
            f"eval {ckpt} (step {row['step']}): loss {row['loss']:.6f}  perplexity {row['perplexity']:.4f}  "
            f"({row['tokens']:,} tokens of {row['data']}; {row['engine']} at world {world.world_size})",
            flush=True,
        )
        if own:
            print("  (eval.data=train: the run's own training documents, which it trained on: not a held-out loss)", flush=True)
        for task in row.get("tasks", []):
            print(task_line(task), flush=True)
    return row


def _evaluate(ckpt: Path, cfg: Config, world: World) -> dict[str, Any]:
    saved = checkpoint.TrainerState.read(ckpt)
    dims = dims_for(cfg.parallel, world.world_size)
    cfg = _batch_at(cfg, dims.dp_size)
    data = _training_data(cfg)
    if not cfg.eval.data and data.fingerprint != saved.data_fingerprint:
        raise UserError(
            f"{ckpt} was trained on other tokens than data.paths={cfg.data.paths} holds now (data fingerprint "
            f"{saved.data_fingerprint}, now {data.fingerprint}): its held-out documents are not known here; accepted: the "
            "run's data, or eval.data=PATHS"
        )
    spec = model_spec(cfg, data.vocab_size, data.eos_id)
    if spec.config() != saved.model:
        raise UserError(
            f"{ckpt} holds another model than its config describes now ({saved.model}); accepted: no model.* override"
        )
    evalset = open_eval_set(cfg, world, data, dims.dp_size)  # before anything is allocated
    tasks = open_tasks(cfg, str(data.tokenizer_path), data.eos_id)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(spec, world, dims, cfg, decay_groups(cfg.train))
    try:
        layout = ParamLayout(spec.build_meta(cfg.data.seq_len))
        checkpoint.resume_state(ckpt, world, engine, layout, dims.as_dict())
        attach_expert_bias(cfg, engine.model, world.device, saved.expert_bias, lambda load: None)  # routes as trained
        row = evaluate(engine, evalset, eval_loss(spec), world, dims.dp_rank(world.rank), dims.dp_size, lambda: None)
        scored = evaluate_tasks(engine, tasks, world, dims, lambda: None)
        tasks_rows = [{"step": saved.step, **r} for r in scored]
        return {"step": saved.step, **row, "engine": engine.name} | ({"tasks": tasks_rows} if tasks_rows else {})
    finally:
        del engine


def _batch_at(cfg: Config, dp: int) -> Config:
    """The run's global batch on `dp` ranks: what decides the eval set. The micro-batch only
    shapes the forwards (a pipeline's schedule, DeepSpeed's batch settings): where the saved
    one does not divide this world's share, the largest that divides both."""
    n = per_rank(cfg.train, dp)  # one line if the global batch does not split over dp ranks
    t = cfg.train
    micro = t.micro_batch if n % t.micro_batch == 0 else math.gcd(n, t.micro_batch)
    cfg = cfg.model_copy(update={"train": t.model_copy(update={"micro_batch": micro, "grad_accum": n // micro})})
    return settle(cfg, dp)


def _training_data(cfg: Config) -> Any:
    """The run's prepared data (its held-out documents, its tokenizer): read, never prepared."""
    if cfg.data.mix:
        return open_mix(cfg.data, cfg.train.seed, held_out=cfg.eval.held_out)
    where, inputs = resolve_dataset_dir(cfg.data)
    if inputs is not None and not (where / MANIFEST).is_file():
        raise UserError(
            f"the run's data ({', '.join(cfg.data.paths) or 'the default corpus'}) is not prepared under data.dir={cfg.data.dir} "
            "here; accepted: data.dir=<the run's data directory>, or data.paths=<its prepared directory>"
        )
    return PackedTokens(where, cfg.data.seq_len, cfg.train.seed, held_out=cfg.eval.held_out, store=store_options(cfg.data))
