"""Evaluation: the eval loss and perplexity of the model as it stands, on a fixed set of
held-out windows, during training (`Evaluation`, one of the loop's collaborators) and from
a checkpoint (`scaletrain eval`, training/eval_checkpoint.py).

The eval set is the first eval.batches x train.global_batch windows of the eval stream
(data/heldout.py: the documents eval.split held out of training, or eval.data's tokens),
read in order, the same ones at every evaluation. Each data-parallel rank takes its share
of each global eval batch, in micro-batches of eval.micro_batch; the engine runs forward
only (Engine.evaluate) and returns the sum of the per-token losses and the token count;
one all-reduce over every rank adds both up, and the loss is sum / count: the mean over
every eval token, at any world size, engine, micro-batch or layout (the ranks of a
tensor-parallel group, which hold the same loss, and the pipeline stages that hold none
scale the sum and the count alike). Perplexity is exp(loss).

What is evaluated is the model's next-token cross entropy alone: no mixture of experts'
auxiliary terms, no distillation terms; with a teacher only the student runs.

Each evaluation is one event row of metrics.jsonl (docs/telemetry.md):
  {"step", "event": "eval", "loss", "perplexity", "tokens", "samples", "data", "eval_s"}
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scaletrain.config import Config
from scaletrain.config.batch import global_batch
from scaletrain.config.eval import DEFAULT_BATCHES, eval_problem
from scaletrain.config.parallel import ParallelDims
from scaletrain.data import MANIFEST, PackedTokens, ensure_prepared, resolve_dataset_dir
from scaletrain.data.heldout import Windows
from scaletrain.data.loader import split_sample, trained_targets
from scaletrain.data.remote import store_options
from scaletrain.engines import Engine, MicroBatch
from scaletrain.errors import UserError
from scaletrain.launch.distributed import World, rank0_first
from scaletrain.models import ModelSpec
from scaletrain.models.loss import logits_of
from scaletrain.models.spec import LossFn
from scaletrain.training.paths import make_dir
from scaletrain.training.tasks import TaskSet, evaluate_tasks

EVENT = "eval"


def eval_loss(spec: ModelSpec) -> LossFn:
    """The spec's own cross entropy (chunked as configured; loss_parallel works on it as in
    training) on the logits alone: a built-in mixture of experts returns (logits, its
    routers' auxiliary loss) and a Hugging Face one an output holding aux_loss, which the
    spec's training loss adds and an evaluation leaves out."""

    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = output[0] if isinstance(output, tuple) else logits_of(output)
        return spec.loss(logits, targets)

    return loss


@dataclass
class EvalSet:
    windows: Windows
    data: str  # where the windows come from, for the row and the log
    global_batch: int  # sequences per eval batch (train.global_batch)
    batches: int
    micro_batch: int  # sequences per rank per forward
    masked: bool = False  # fine-tuning records: the loss over their trained targets (data/loader.py)
    note: str = ""  # a line for the log: eval.batches unset and fewer batches than the default held

    @property
    def samples(self) -> int:
        return self.batches * self.global_batch

    @cached_property
    def tokens(self) -> int:
        """The targets the loss is the mean over: every one, or fine-tuning records' trained ones."""
        if not self.masked:
            return self.samples * self.windows.seq_len
        return trained_targets(self.windows.batch(np.arange(self.samples)))

    def rank_batches(self, dp_rank: int, dp_size: int) -> Iterator[list[MicroBatch]]:
        """This rank's micro-batches of each global eval batch: rank r takes the r-th
        contiguous share of the batch's windows (global_batch divides by dp_size: config/batch.py)."""
        share = self.global_batch // dp_size
        for b in range(self.batches):
            first = b * self.global_batch + dp_rank * share
            out = []
            for start in range(first, first + share, self.micro_batch):
                t = torch.from_numpy(self.windows.batch(np.arange(start, min(start + self.micro_batch, first + share))))
                out.append(split_sample(t, self.masked))
            yield out


def open_eval_set(cfg: Config, world: World, data: Any, dp_size: int) -> EvalSet:
    """The eval set of `cfg` over the training data `data` (whose held-out documents it reads
    under eval.split); eval.data is prepared here with the training data's tokenizer if it
    is text. One-line UserErrors: nothing to evaluate on, too few windows."""
    e = cfg.eval
    problem = eval_problem(e, cfg.parallel.pp, cfg.parallel.pp_schedule)
    if problem:
        raise UserError(problem)
    if e.data:
        tokens = _eval_tokens(cfg, world, data)
        windows = Windows(tokens.documents(held=False), cfg.data.seq_len)
        masked = tokens.masked
        where = f"eval.data={','.join(e.data)}"
    elif e.held_out > 0 and getattr(data, "split", None) is not None:
        split = data.split
        windows = Windows(data.documents(held=True), cfg.data.seq_len)
        masked = data.masked
        where = f"eval.split={e.held_out:g} ({split.held_documents} of {split.documents} documents)"
    else:
        raise UserError(
            f"eval: nothing to evaluate on: eval.split={e.held_out:g} held no training document out"
            + (" (held-out documents of data.mix are not built yet)" if e.held_out > 0 else "")
            + "; accepted: eval.data=PATHS"
            + (
                ""
                if e.held_out > 0
                else ", eval.data=train (`scaletrain eval`: the run's own training documents), or a run trained with "
                "eval.split > 0 (eval.every > 0 holds 1% of the documents out)"
            )
        )
    g = global_batch(cfg.train, dp_size)
    fits = windows.count // g
    batches = e.batches or min(DEFAULT_BATCHES, fits)  # unset: what the data holds, up to the default
    need = max(batches, 1) * g
    if windows.count < need:
        asked = f"eval.batches={e.batches}" if e.batches else "one eval batch"
        raise UserError(
            f"{asked} needs {need} windows of {cfg.data.seq_len} tokens ({max(batches, 1)} x train.global_batch={g}), "
            f"but {where} holds {windows.count}; accepted: "
            + (f"eval.batches <= {fits}, " if fits else "")
            + ("a larger eval.split, " if not e.data else "")
            + "or more eval data"
        )
    evalset = EvalSet(windows, where, g, batches, e.micro_batch or cfg.train.micro_batch, masked)
    if not e.batches and batches < DEFAULT_BATCHES:
        evalset.note = (
            f"eval: {batches} global batch{'es' * (batches != 1)} of {g} sequences per evaluation, what {where} holds "
            f"(eval.batches unset: up to {DEFAULT_BATCHES}); a larger eval.split or more eval.data holds more"
        )
    if evalset.tokens == 0:
        raise UserError(
            f"eval: the {need} windows of {where} hold no trained token (fine-tuning records' prompts only); "
            "accepted: more eval.batches, or eval data with responses"
        )
    return evalset


def _eval_tokens(cfg: Config, world: World, data: Any) -> PackedTokens:
    """eval.data as a prepared dataset tokenized like the training data: a prepared directory
    (or one in object storage) as given, or text prepared into data.dir's cache with the
    training data's tokenizer (rank 0)."""
    text = cfg.data.model_copy(update={"paths": list(cfg.eval.data), "tokenizer": str(data.tokenizer_path)})
    where, inputs = resolve_dataset_dir(text, "eval.data")
    if inputs is not None and not (where / MANIFEST).is_file():
        make_dir(cfg.data.dir, "data.dir", create=world.is_main)
        rank0_first(
            world,
            lambda: ensure_prepared(text, show_progress=True, what="eval.data"),
            "preparing the eval data",
            cfg.data.prepare_timeout_s,
            hint="accepted: a larger data.prepare_timeout_s, or eval.data=<a directory prepared beforehand>",
        )
    tokens = PackedTokens(where, cfg.data.seq_len, cfg.train.seed, store=store_options(cfg.data))
    # A prepared directory: the same token ids must mean the same text (its tokenizer, a
    # local copy of it for a URL, against the training data's).
    if inputs is None and _sha256(Path(tokens.tokenizer_path)) != _sha256(Path(data.tokenizer_path)):
        raise UserError(
            f"eval.data: {where} was tokenized with another tokenizer than the training data ({data.tokenizer_path}); "
            f"accepted: text globs (tokenized here with the training tokenizer), or a directory made by "
            f"`scaletrain data prepare --tokenizer {data.tokenizer_path}`"
        )
    return tokens


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def evaluate(
    engine: Engine, evalset: EvalSet, loss: LossFn, world: World, dp_rank: int, dp_size: int, beat: Callable[[], None]
) -> dict[str, Any]:
    """Collective: the eval row's figures for the model as the engine holds it now."""
    start = time.perf_counter()
    local = torch.zeros(2, dtype=torch.float64, device=world.device)
    for micro_batches in evalset.rank_batches(dp_rank, dp_size):
        loss_sum, tokens = engine.evaluate(micro_batches, loss)
        local += torch.stack([loss_sum, tokens])
        beat()  # each eval batch is progress: the hang watchdog still watches the evaluation
    if world.distributed:
        torch.distributed.all_reduce(local)
    loss_sum, tokens = local.tolist()
    mean = loss_sum / tokens
    return {
        "loss": mean,
        "perplexity": _exp(mean),
        "tokens": evalset.tokens,
        "samples": evalset.samples,
        "data": evalset.data,
        "eval_s": time.perf_counter() - start,
    }


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:  # past ~709 nats (a diverged model): the perplexity is no float
        return math.inf


class Evaluation:
    """The loop's collaborator: whether an evaluation is due (every eval.every steps and
    after the last step), running it and reporting it (metrics.jsonl, the sinks, the
    progress line). The step rows are flushed first, so metrics.jsonl stays in step order
    and W&B, which drops a step below the last it was given, keeps them."""

    def __init__(
        self,
        cfg: Config,
        world: World,
        engine: Callable[[], Engine],  # the run's, held by the run alone (training/trainer.py)
        evalset: EvalSet | None,
        loss: LossFn,
        dims: ParallelDims,
        flush: Callable[[], None],
        report: list[Callable[[dict[str, Any]], None]],
        beat: Callable[[], None],
        forget: Callable[[], None],
        tasks: TaskSet | None = None,
    ):
        self.every = cfg.eval.every if evalset is not None else 0
        self.tasks = tasks  # eval.tasks (training/tasks.py): scored after the loss, one row each
        self.world, self.engine, self.evalset, self.loss = world, engine, evalset, loss
        self.dims, self.dp_rank, self.dp_size = dims, dims.dp_rank(world.rank), dims.dp_size
        self.flush, self.report, self.beat = flush, report, beat  # report: metrics.jsonl + sinks, the progress line
        self.forget = forget  # what the forwards left in training's telemetry (a mixture of experts' routing counts)

    def due(self, step: int, last: bool) -> bool:
        return self.every > 0 and (last or step % self.every == 0)

    def after_step(self, step: int, last: bool) -> dict[str, Any] | None:
        """Collective: the evaluation of `step` if one is due; its row."""
        if not self.due(step, last):
            return None
        assert self.evalset is not None
        self.flush()
        row = {
            "step": step,
            "event": EVENT,
            **evaluate(self.engine(), self.evalset, self.loss, self.world, self.dp_rank, self.dp_size, self.beat),
        }
        scored = evaluate_tasks(self.engine(), self.tasks, self.world, self.dims, self.beat) if self.tasks else []
        rows = [row] + [{"step": step, **r} for r in scored]
        self.forget()
        for r in rows:
            for report in self.report:
                report(r)
        return row
