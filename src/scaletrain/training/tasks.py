"""Downstream task accuracy (eval.tasks) of the model as the engine holds it: each task's
(context, continuation) pairs (data/tasks.py) scored by log-likelihood through the engine's
own forward-only path (Engine.evaluate), at each evaluation and by `scaletrain eval`.

Batched by length: the pairs sorted longest first, `micro_batch` to a forward, each batch
padded to the next power of two of its longest pair (a compiled model sees a handful of
shapes, not one per batch), the padding's targets not scored. The forwards are dealt to
the data-parallel ranks in turn, each rank running the same number (a rank with fewer
repeats its last: FSDP and ZeRO-3 gather parameters in every forward, so every rank takes
part in each); one all-reduce then brings every pair's figures to every rank. A pair's
log-likelihood is the sum over its continuation's tokens of log-softmax in fp32, as
lm-evaluation-harness computes it, whatever the micro-batch and world size: each pair is one
row of its forward, and no row's figure depends on another's.

Tensor, pipeline and context parallel split a sequence or its vocabulary over ranks, so a
pair's figures would be partial on each: refused in one line (`tasks_problem`); evaluation
of the loss runs there as before.

Each task is one event row of metrics.jsonl (docs/evaluation.md):
  {"step", "event": "task", "task", "kind", "acc", "acc_norm" (multiple choice),
   "perplexity" (last word), "items", "shots", "eval_s"}
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from scaletrain.config import Config
from scaletrain.config.eval import TaskConfig
from scaletrain.config.parallel import ParallelDims
from scaletrain.data.tasks import Item, Request, load_items, requests
from scaletrain.engines import Engine
from scaletrain.errors import UserError
from scaletrain.launch.distributed import World
from scaletrain.models.loss import IGNORE_INDEX, logits_of

EVENT = "task"


def tasks_problem(cfg: Config) -> str | None:
    """eval.tasks with a layout that cannot score a pair on one rank, or None."""
    p = cfg.parallel
    split = [f"parallel.{k}={v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp)) if v > 1]
    if cfg.eval.tasks and split:
        return (
            f"eval.tasks with {', '.join(split)}: a pair's log-likelihood would be split over ranks, which task scoring "
            "does not gather yet; accepted: eval.tasks=[] on this layout (the eval loss runs), or `scaletrain eval "
            "RUN eval.tasks=...` at a layout without them (a checkpoint reshards onto any)"
        )
    return None


@dataclass
class Task:
    """A task read and tokenized once: its items and the pairs to score."""

    config: TaskConfig
    items: list[Item]
    pairs: list[Request]


@dataclass
class TaskSet:
    """eval.tasks ready to score: each task, and how its pairs go to the forwards."""

    tasks: list[Task]
    how: Batching


def open_tasks(cfg: Config, tokenizer_path: str, eos_id: int | None) -> TaskSet:
    """eval.tasks read and tokenized with the run's tokenizer (every rank: the same files);
    eval.micro_batch (unset: train.micro_batch) pairs a forward, in data.seq_len's window."""
    problem = tasks_problem(cfg)
    if problem:
        raise UserError(problem)
    how = Batching(cfg.eval.micro_batch or cfg.train.micro_batch, cfg.data.seq_len, eos_id or 0)
    if not cfg.eval.tasks:
        return TaskSet([], how)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    out = []
    for task in cfg.eval.tasks:
        items = load_items(task)
        out.append(Task(task, items, requests(items, encode, cfg.data.seq_len, how.pad, task.name)))
    return TaskSet(out, how)


class _Scorer:
    """A loss for Engine.evaluate that also keeps each row's figures: the sum of the scored
    targets' log-probabilities and whether each is the greedy choice. Returns the mean
    negative log-likelihood over the scored targets (Engine.evaluate's contract)."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def __call__(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output[0] if isinstance(output, tuple) else output).float()
        scored = targets != IGNORE_INDEX
        picked = targets.clamp(min=0).unsqueeze(-1)
        logp = F.log_softmax(logits, dim=-1).gather(-1, picked).squeeze(-1) * scored
        greedy = (logits.argmax(dim=-1) == targets) | ~scored
        self.rows.append(torch.stack([logp.double().sum(dim=1), greedy.all(dim=1).double()], dim=1))
        return -logp.sum() / scored.sum().clamp(min=1)


@dataclass(frozen=True)
class Batching:
    """How pairs go to the forwards: `micro_batch` pairs each, inputs of at most `window`
    tokens (data.seq_len: the model's positions), `pad` the token after a pair's end."""

    micro_batch: int
    window: int
    pad: int


def score(
    engine: Engine, pairs: list[Request], world: World, dims: ParallelDims, how: Batching, beat: Callable[[], None]
) -> np.ndarray:
    """Collective: [pairs, 2] float64, each pair's log-likelihood and greedy exact match (0/1)."""
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i].tokens))
    batches = [order[i : i + how.micro_batch] for i in range(0, len(order), how.micro_batch)]
    rank, ranks = dims.dp_rank(world.rank), dims.dp_size
    mine = batches[rank::ranks]
    rounds = math.ceil(len(batches) / ranks)
    figures = torch.zeros(len(pairs), 2, dtype=torch.float64, device=world.device)
    for k in range(rounds):
        batch = mine[k] if k < len(mine) else (mine[-1] if mine else batches[0])  # a repeat: its figures dropped
        scorer = _Scorer()
        engine.evaluate([_tensors([pairs[i] for i in batch], how)], scorer)
        if k < len(mine):
            figures[batch] = scorer.rows[0].to(figures.device)
        beat()  # each forward is progress: the hang watchdog still watches
    if world.distributed:
        torch.distributed.all_reduce(figures)
    return figures.cpu().numpy()


def _tensors(batch: list[Request], how: Batching) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch of pairs: inputs padded at the end (causal attention: no earlier
    position sees the padding) to the next power of two of the longest (at most the
    window), targets scored on each pair's continuation only."""
    longest = max(len(r.tokens) - 1 for r in batch)
    length = min(1 << max(3, (longest - 1).bit_length()), how.window)
    inputs = torch.full((len(batch), length), how.pad, dtype=torch.long)
    targets = torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long)
    for row, r in enumerate(batch):
        tokens = torch.tensor(r.tokens, dtype=torch.long)
        n = len(r.tokens) - 1
        inputs[row, :n] = tokens[:-1]
        targets[row, n - r.scored : n] = tokens[-r.scored :]
    return inputs, targets


def task_row(task: Task, figures: np.ndarray, seconds: float) -> dict[str, Any]:
    """A task's figures from its pairs' (see the module doc for the row)."""
    t = task.config
    row: dict[str, Any] = {"event": EVENT, "task": t.name, "kind": t.kind}
    if t.kind == "last_word":
        row["acc"] = float(figures[:, 1].mean())
        row["perplexity"] = _exp(-float(figures[:, 0].mean()))
    else:
        right = norm = 0
        at = 0
        for item in task.items:
            n = len(item.continuations)
            ll = figures[at : at + n, 0]
            at += n
            right += int(np.argmax(ll)) == item.answer
            norm += int(np.argmax(ll / np.asarray(item.chars, dtype=np.float64))) == item.answer
        row["acc"] = right / len(task.items)
        if t.layout != "winogrande":  # one continuation for every choice: acc_norm is acc
            row["acc_norm"] = norm / len(task.items)
    return row | {"items": len(task.items), "shots": t.shots, "eval_s": seconds}


def evaluate_tasks(
    engine: Engine, taskset: TaskSet, world: World, dims: ParallelDims, beat: Callable[[], None]
) -> list[dict[str, Any]]:
    """Collective: one row per task for the model as the engine holds it now."""
    rows = []
    for task in taskset.tasks:
        start = time.perf_counter()
        figures = score(engine, task.pairs, world, dims, taskset.how, beat)
        rows.append(task_row(task, figures, time.perf_counter() - start))
    return rows


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
