"""The training loop, in the order of the data flow:
world -> run directory -> data -> plan + layout -> resume checks -> engine -> resume ->
steps (forward_backward, step, metrics, checkpoints) -> summary.

`start` builds what a run works with (a `Run`: the engine, the batches, telemetry, guards,
checkpoints) and registers each closing action on one ExitStack; `loop` drives them one
optimizer step at a time (`train_step`); each collaborator owns its policy (Saves: is a
checkpoint due; the guards: is a check due; faults.Drills: the fault points).
"""

from __future__ import annotations

import gc
import signal
import time
from contextlib import ExitStack, closing
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from rich.console import Console

from scaletrain import checkpoint
from scaletrain.checkpoint.neutral import ParamLayout
from scaletrain.checkpoint.state import TrainerState
from scaletrain.config import AUTO_MICRO_BATCH, Config
from scaletrain.config.batch import global_batch
from scaletrain.config.parallel import ParallelDims, describe, dims_for
from scaletrain.data import (
    DataMix,
    MixShares,
    PackedTokens,
    RankBatches,
)
from scaletrain.engines import Engine, build_engine
from scaletrain.errors import OutOfMemoryRestart, Preempted, UserError
from scaletrain.launch.distributed import World, all_hostnames, broadcast_object, init_distributed, shutdown
from scaletrain.models import ModelSpec, distill_spec, model_spec
from scaletrain.models.capabilities import check_layout
from scaletrain.models.distill import Distill
from scaletrain.models.documents import measured_context
from scaletrain.models.loss import trained
from scaletrain.models.moe import ExpertBias, attach_expert_bias, routing_stats
from scaletrain.models.spec import with_fields
from scaletrain.optim.optimizers import decay_groups, describe_groups, group_lrs
from scaletrain.optim.schedule import lr_at, scaled_lr
from scaletrain.resilience import oom
from scaletrain.resilience.faults import Drills
from scaletrain.resilience.nonfinite import NonfiniteGuard
from scaletrain.resilience.preempt import PreemptionWatch
from scaletrain.resilience.replica_groups import NoGroups, ReplicaGroups, data_ranks, writes_checkpoints
from scaletrain.resilience.spikes import SpikeGuard
from scaletrain.resilience.watchdog import Watchdog
from scaletrain.resilience.weights import ReplicaCheck
from scaletrain.telemetry import MetricsLog, TrainProgress, print_banner, print_run_summary
from scaletrain.telemetry.session import Telemetry
from scaletrain.training import defaults
from scaletrain.training.attention_kernel import attention_kernel
from scaletrain.training.evaluation import Evaluation, eval_loss, open_eval_set
from scaletrain.training.preflight import plan_run, runtime_target
from scaletrain.training.rundir import RunPaths, check_resume, write_run_info
from scaletrain.training.saves import Saves
from scaletrain.training.startup import Flush, Held, Say, checkpoint_to_resume, directories, identity, training_data
from scaletrain.training.state import Identity, Position, Stateful, restore
from scaletrain.training.tasks import open_tasks


def train(cfg: Config, console: Console | None = None) -> dict[str, Any]:
    if cfg.model.source == "python":
        # tp, pp, cp, ep a model of your own does not offer: refused before any rank joins a group, so that
        # every rank stops on the same line and none is left waiting on a store rank 0 has closed.
        check_layout(model_spec(cfg, cfg.data.vocab_size), cfg.parallel)
    world = init_distributed(cfg.run.device, cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        return _train(cfg, world, console or Console())
    finally:
        # A DDP model still alive at destroy_process_group intermittently aborts gloo
        # ("terminate called without an active exception"); the run dropped its engine,
        # and this frees what reference cycles still hold before the group goes.
        gc.collect()
        shutdown(world)


@dataclass
class Run:
    """What one start of a run works with, and where it stands."""

    cfg: Config
    world: World
    say: Any  # a line for the log, rank 0 only
    paths: RunPaths
    resumed_from: Path | None
    held: Held  # the engine, held here alone
    batches: RankBatches
    loss: Any  # the run's loss (with a teacher, it takes both outputs)
    telemetry: Telemetry
    metrics: MetricsLog
    guard: NonfiniteGuard
    spikes: SpikeGuard
    replicas: ReplicaCheck
    watchdog: Watchdog
    watch: PreemptionWatch
    progress: TrainProgress
    saves: Saves
    drills: Drills
    evaluation: Evaluation
    peak_lr: float
    tokens_per_step: int
    # The run's Stateful map (training/state.py): what a checkpoint holds besides the engine's
    # state, each part its own; "position" is where the run stands (its one writer of the step).
    parts: dict[str, Stateful]
    groups: NoGroups | ReplicaGroups = NoGroups()  # fault_tolerance: the quorum of replica groups
    balance: ExpertBias | None = None  # model.moe.balance=bias: the experts' bias, moved after each step

    @property
    def engine(self) -> Engine:
        return self.held.engine()

    @property
    def position(self) -> Position:
        return cast(Position, self.parts["position"])

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.position.step

    @property
    def tokens_seen(self) -> int:
        return self.position.tokens_seen

    def trained_tokens(self) -> int:
        """What a step adds to tokens_seen: its trained tokens (fine-tuning records: their
        responses, counted as the step is taken), else every token of the step."""
        return self.batches.step_tokens if self.batches.masked else self.tokens_per_step

    def position_for_peers(self, in_step: bool) -> dict[str, int]:
        """What a replica group sends a rejoining one besides the engine's state; `in_step`:
        from inside the optimizer step (DiLoCo's hook), as it is once that step ends (the data
        position has moved on already: the step's batch was taken before its forward)."""
        step, tokens = (self.step + 1, self.tokens_seen + self.trained_tokens()) if in_step else (self.step, self.tokens_seen)
        return {"step": step, "position": self.batches.position, "tokens_seen": tokens}

    def take_position(self, state: dict[str, int]) -> None:
        """A replica group's position, caught up with from its peers."""
        self.position.load_state_dict(
            {"step": state["step"], "tokens_seen": state["tokens_seen"], "data_position": state["position"]}
        )
        self.progress.advance(self.step)


def _train(cfg: Config, world: World, console: Console) -> dict[str, Any]:
    first, clock = None, time.perf_counter()
    while True:
        try:
            with ExitStack() as stack:
                run = start(cfg, world, console, stack)
                first = run.step if first is None else first
                loop(run)
            break
        except OutOfMemoryRestart:  # one process: again from the newest checkpoint, smaller micro-batches (resilience/oom.py)
            pass
        gc.collect()  # the failed attempt's tensors, held by reference cycles, before the next one allocates
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    summary = {"run_dir": str(run.paths.root), "steps": run.step, "steps_this_run": run.step - (first or 0)}
    summary["elapsed_s"] = time.perf_counter() - clock
    # The closing table reads the metrics once on rank 0; its last losses go to every rank.
    losses = print_run_summary(console, run.paths, summary, run.resumed_from) if world.is_main else {}
    summary |= broadcast_object(world, losses)
    return summary


def loop(run: Run) -> None:
    """Optimizer steps until train.steps (or train.stop_at), a preemption, or an error."""
    last = run.cfg.train.stop_at or run.cfg.train.steps
    while run.step < last:
        train_step(run)
        run.progress.advance(run.step)
        if read_due(run, last) and settle(run):
            roll_back(run)
            continue
        if run.replicas.due(run.step):
            check_replicas(run)
        run.evaluation.after_step(run.step, run.step == last)  # before the save: no checkpoint without its eval row
        run.saves.after_step(run.step, run.step == last)
        run.drills.after_step(run.step)
        stop = run.watch.agreed()  # a preemption signal on any rank stops all after the same step
        if stop:
            run.saves.stop(run.step)
            raise Preempted(run.step, signal.Signals(stop).name)


def read_due(run: Run, last: int) -> bool:
    """Whether the host reads the device's figures after this step: at the end of a log
    interval, and before whatever must know that no step since the last read went wrong
    (a checkpoint, an evaluation, a replica check, the end). Between them a step reads
    nothing from the device (docs/gpu.md)."""
    step, is_last = run.step, run.step == last
    return (
        step % run.cfg.train.log_every == 0
        or is_last
        or run.saves.due(step, is_last)
        or run.evaluation.due(step, is_last)
        or run.replicas.due(step)
    )


def settle(run: Run) -> bool:
    """Collective: the interval's metrics read, reviewed by the guards (the non-finite one
    may stop the run) and shown; True when a guard calls for a rollback."""
    run.progress.show(run.telemetry.flush())
    return run.guard.rollback_due or run.spikes.rollback_due


def _review(guard: NonfiniteGuard, spikes: SpikeGuard, rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> Any:
    """Telemetry's review of each interval's rows: the spike guard's rows join the events; the
    non-finite guard's stop, if any, is returned."""
    events += spikes.review(rows)
    return guard.review(rows)


def train_step(run: Run) -> None:
    """Optimizer step run.step + 1: forward and backward over the accumulation window, the
    engine's step, its metrics, all without reading anything from the device."""
    run.groups.before_step()  # replica groups: a group behind its peers takes their state (step, data position) here
    t0 = time.perf_counter()
    step = run.step + 1
    lr = lr_at(run.step, run.cfg.train, run.peak_lr) * run.spikes.lr_scale(step)
    phase = Phase()
    try:
        with run.telemetry.step(step) as mark:
            first = run.batches.position
            batch = run.batches.next_step()
            run.spikes.took(step, first, run.batches.position)
            mark("data")
            loss = run.groups.mean(run.engine.forward_backward(batch, run.drills.loss(step, run.loss), phase.marking(mark)))
            phase.now = "optimizer"
            # A non-finite step is not applied, whatever the policy; nor one above the spike limit.
            stats = run.engine.step(lr, run.groups.across, run.spikes.limit())
            if run.balance is not None and stats.committed:
                run.balance.after_step()  # from the step's load, every micro-batch and rank
            mark("optimizer")
            if stats.committed:  # else a replica group failed during it: applied nowhere, run again on the next batch
                _record(run, step, lr, loss, stats, time.perf_counter() - t0)
    except torch.OutOfMemoryError as e:
        w = run.world
        oom.survive(run.cfg, run.paths.root, w.world_size, w.rank, run.batches.dp_size, step, phase.now, e, run.saves.let_finish)
        raise  # not reached: survive() ends this attempt
    except RuntimeError:  # a collective failed: because a peer ran out of memory and left?
        if run.world.world_size > 1 and oom.peer_ran_out(run.paths.root, step):
            oom.exit_with_peer(run.saves.let_finish)
        raise


def _record(run: Run, step: int, lr: float, loss: torch.Tensor, stats: Any, dt: float) -> None:
    # `tokens`: the trained ones (fine-tuning records: their responses); tokens_per_s: all processed.
    assert run.position.advance(run.trained_tokens()) == step
    run.watchdog.beat(step)
    scaler = {"loss_scale": stats.loss_scale, "skipped": stats.skipped} if stats.loss_scale is not None else {}
    # train.activation_offload: what this rank's forwards of the step held on the host (engines/offload.py).
    offload = getattr(run.engine, "offload", None)
    moved = {"offloaded_bytes": offload.moved()[1]} if offload is not None else {}
    run.telemetry.record(
        loss, stats.grad_norm, step=step, lr=lr, tokens_per_s=run.tokens_per_step / dt, step_time_s=dt,
        tokens=run.tokens_seen, **scaler, **run.groups.fields(), **moved,
    )  # fmt: skip


class Phase:
    """Which phase of the step is running: the engine marks each one's end."""

    AFTER = {"forward": "backward", "backward": "forward"}  # the next micro-batch's forward

    def __init__(self) -> None:
        self.now = "forward"

    def marking(self, mark: Any) -> Any:
        def marked(phase: str) -> None:
            self.now = self.AFTER.get(phase, phase)
            mark(phase)

        return marked


def roll_back(run: Run) -> None:
    """train.nonfinite=rollback or train.spikes: back to the newest valid checkpoint; its
    later rows go (a spike rollback's own row carries their spike rows)."""
    spikes = not run.guard.rollback_due
    saved = run.saves.roll_back()
    if saved is None:
        raise run.spikes.nothing_to_roll_back() if spikes else run.guard.nothing_to_roll_back()
    state = asdict(saved)
    # The position's step and tokens and the experts' bias go back; the data position stays
    # (training goes on after the batches that failed), and the guard keeps its tally.
    state["data_position"] = run.position.batches.position
    restore(run.parts, state, [name for name in ("position", "expert_bias") if name in run.parts])
    if spikes:
        row = run.spikes.rolled_back(run.step, run.position.batches.position)
        run.say(
            f"spikes: {len(row['spikes'])} spike(s) since step {run.step}; rolled back to it, the data up to sample "
            f"{row['data_skipped_to']} skipped"
        )
    else:
        run.spikes.rollback_due = False  # the non-finite guard's rollback serves both
        run.say(run.guard.rolled_back(run.step))
    run.metrics.truncate_after(run.step)  # the rows of the undone steps; the counters keep the tally
    if spikes:
        run.telemetry.event(row)
    run.progress.advance(run.step)


def check_replicas(run: Run) -> None:
    event = run.replicas.check(run.step, run.engine.model.parameters())
    if event is not None:
        run.telemetry.event(event)  # every check while they differ; said once
    if event is not None and run.replicas.first_seen == run.step:
        run.say(
            f"warning: replicas hold different {event['what']} at step {run.step}: rank(s) {event['ranks']} "
            f"on {', '.join(sorted(set(event['hosts'])))} differ from the others (guards.weight_hash_every)"
        )


def start(cfg: Config, world: World, console: Console, stack: ExitStack) -> Run:
    """Everything before the first step: the collaborators, built by keyword; closing
    actions go on `stack` in the order they must be undone."""
    say = Say(console, world.is_main)
    paths, disks = directories(cfg, world, say, stack)
    cfg, resume_from = checkpoint_to_resume(cfg, world, paths, say)
    plan = _checked_plan(cfg, world, paths, resume_from, say)
    cfg, spec, dims = plan.cfg, plan.spec, plan.dims
    batches, (evalset, tasks) = _batches(plan, world)
    if evalset is not None and evalset.note:
        say(evalset.note)
    stack.enter_context(attention_kernel(cfg, spec, dims.cp, world, say))  # SDPA's kernel for the whole run
    torch.manual_seed(cfg.train.seed)
    held = Held(build_engine(spec, world, dims, cfg, decay_groups(cfg.train), plan.distill.teacher if plan.distill else None))
    layout = ParamLayout(spec.build_meta(cfg.data.seq_len))
    resumed = _resume(resume_from, world, held.engine(), layout, dims, say) if resume_from else None
    step, hosts = resumed.step if resumed else 0, all_hostnames(world)
    metrics, telemetry = _telemetry(plan, world, paths, batches.dp_size, hosts, step, stack)
    guard = NonfiniteGuard(cfg.train, cfg.precision)
    spikes = SpikeGuard(cfg.train.spikes, getattr(plan.data, "origin", None))
    # The parts restored before anything reads them (the data mixture's shares read the position from here on).
    parts = _parts(plan, world, batches, {"nonfinite": guard, "spikes": spikes, "telemetry": telemetry}, resumed)
    _announce(plan, world, console, held.engine(), telemetry, paths, (hosts, batches, resume_from), say)
    progress, watch, watchdog = _watchers(cfg, world, console, paths, step, stack)
    flush = Flush(telemetry, progress)
    saves = Saves(
        cfg, world, engine=held.engine, paths=paths, metrics=metrics, layout=layout, parts=parts, before_save=flush,
        paused=watchdog.paused, say=say, writes=writes_checkpoints(cfg), tokenizer=Path(plan.data.tokenizer_path), disks=disks,
    )  # fmt: skip
    telemetry.review = partial(_review, guard, spikes)  # each interval's steps, as they are read
    stack.push(saves.wait_on_clean_stop)
    stack.callback(watchdog.close)  # first: a long wait at the end is no hang
    sequences = global_batch(cfg.train, batches.dp_size)
    run = Run(
        cfg=cfg, world=world, say=say, paths=paths, resumed_from=resume_from, held=held, batches=batches,
        loss=_loss(plan, batches), telemetry=telemetry, metrics=metrics, guard=guard, spikes=spikes,
        replicas=ReplicaCheck(world, held.engine().name, cfg.guards.weight_hash_every, hosts, dims),
        watchdog=watchdog, watch=watch, progress=progress, saves=saves, drills=Drills(held.model, saves.wait, watch.received),
        evaluation=Evaluation(
            cfg, world, held.engine, evalset, eval_loss(spec), dims, flush, [telemetry.event, progress.evaluated],
            watchdog.beat, telemetry.drop_routing, tasks,
        ),
        peak_lr=scaled_lr(cfg.train, sequences), tokens_per_step=sequences * cfg.data.seq_len, parts=parts,
    )  # fmt: skip
    _attach_model_state(run, resumed, dims, stack)
    # The engine (a DDP wrapper, say) must not outlive the process group (see train()),
    # whatever an exception's traceback still holds.
    stack.callback(held.release)
    return run


def _batches(plan: Planned, world: World) -> tuple[RankBatches, Any]:
    """This rank's batches (from the start: a resume's Position moves them) and what an
    evaluation reads: the global batch's windows (too few: said now; replica groups each
    evaluate all of them) and eval.tasks, read and tokenized (a bad record: said now)."""
    cfg, data = plan.cfg, plan.data
    dp_rank, dp_size = data_ranks(cfg, plan.dims, world.rank)
    evalset = open_eval_set(cfg, world, data, dp_size) if cfg.eval.every > 0 else None
    tasks = open_tasks(cfg, str(data.tokenizer_path), data.eos_id) if evalset is not None else None
    return RankBatches(data, cfg.train.micro_batch, cfg.train.grad_accum, dp_rank, dp_size), (evalset, tasks)


def _parts(
    plan: Planned, world: World, batches: RankBatches, others: dict[str, Stateful], resumed: TrainerState | None
) -> dict[str, Stateful]:
    """The run's Stateful map (training/state.py), each part restored from the checkpoint resumed."""
    parts: dict[str, Stateful] = {
        "position": Position(batches),
        "identity": Identity(identity(plan.cfg, world, plan.dims, plan.spec, plan.data)),
        **others,
    }
    if resumed is not None:
        restore(parts, asdict(resumed), parts)
    return parts


def _loss(plan: Planned, batches: RankBatches) -> Any:
    """The run's loss: the student's against its teacher (model.teacher), else the model's;
    fine-tuning records' weighted per trained token."""
    loss = plan.distill.loss if plan.distill else plan.spec.loss
    return per_trained_token(loss, batches, batches.dp_size * plan.dims.cp) if plan.data.masked else loss


def _telemetry(
    plan: Planned, world: World, paths: RunPaths, dp_size: int, hosts: list[str], step: int, stack: ExitStack
) -> tuple[MetricsLog, Telemetry]:
    """metrics.jsonl (rows after the resumed step dropped) and telemetry, closed with the run."""
    cfg = plan.cfg
    metrics = MetricsLog(paths.metrics, enabled=world.is_main)
    if writes_checkpoints(cfg):  # a replica group without checkpoints starts at 0 each life: its rows stay
        metrics.truncate_after(step)
    # The PaLM count (6 per matmul parameter and token) less the weight gradients a frozen base
    # never computes: a LoRA run of the 1b shape reported MFU 112% on a lent H200 without this.
    flops = plan.spec.flops_per_token(cfg.data.seq_len) - 2.0 * plan.spec.counts().frozen_matmul
    telemetry = Telemetry(cfg, world, dp_size, hosts, flops, paths.root, metrics, step)
    stack.callback(telemetry.close)
    return metrics, telemetry


def _watchers(
    cfg: Config, world: World, console: Console, paths: RunPaths, step: int, stack: ExitStack
) -> tuple[TrainProgress, PreemptionWatch, Watchdog]:
    """What watches the run: the progress line, the preemption signal and the hang watchdog
    (which the caller closes once the saves' wait is registered)."""
    progress = stack.enter_context(
        closing(TrainProgress(console, cfg.train.steps, step, cfg.train.log_every, enabled=world.is_main))
    )
    watch = stack.enter_context(closing(PreemptionWatch(world)))
    return progress, watch, Watchdog(world, paths.root, cfg.guards.hang_timeout_s, say=Say(None, True))


def _announce(
    plan: Planned, world: World, console: Console, engine: Engine, telemetry: Telemetry, paths: RunPaths, about: tuple[Any, ...],
    say: Say,
) -> None:  # fmt: skip
    """Rank 0: the engine's files, run.json, what the engine and the optimizer groups are, the
    banner; every rank: telemetry's readers of the optimizer groups and the data mixture."""
    cfg, dims, spec, data = plan.cfg, plan.dims, plan.spec, plan.data
    hosts, batches, resume_from = about
    sequences = global_batch(cfg.train, batches.dp_size)
    if world.is_main:
        oom.log_new(paths.root, telemetry.event)
    described, lines = engine.describe()  # e.g. a pipeline's stages
    if (cfg.train.param_groups or cfg.train.optimizer != "adamw") and hasattr(engine, "optimizer"):  # what each group got
        lines = [*lines, *describe_groups(engine.optimizer)]
        telemetry.recorder.group_lrs = partial(group_lrs, engine.optimizer)  # and at what rate, each interval
    if isinstance(data, DataMix):  # each interval's realised shares (data/mix.py), computed, not gathered
        telemetry.recorder.mix = MixShares(data, partial(getattr, batches, "position")).take
    if not world.is_main:
        return
    for name, text in engine.checkpoint_files().items():  # e.g. the exact DeepSpeed JSON
        (paths.root / name).write_text(text)
    write_run_info(paths, cfg, world, dims, hosts, resume_from, telemetry.run_info() | described)
    for line in lines:
        say(line)
    peak_lr, tokens = scaled_lr(cfg.train, sequences), sequences * cfg.data.seq_len
    print_banner(console, cfg, world, spec, data.samples_per_epoch, tokens, sequences, peak_lr, resume_from)


def _attach_model_state(run: Run, resumed: TrainerState | None, dims: ParallelDims, stack: ExitStack) -> None:
    """What the run keeps of the model beside the engine: replica groups' quorum
    (fault_tolerance), the experts' bias (joins the Stateful map), and the experts' load per
    interval, counted by one rank of each tp group (all of them route the same tokens: llama_tp.py)."""
    cfg, world, telemetry = run.cfg, run.world, run.telemetry
    if cfg.fault_tolerance.groups > 1:
        run.groups = ReplicaGroups(
            cfg, world, run.held.engine, run.step, run.position_for_peers, run.take_position, telemetry.event
        )
        stack.push(partial(_close_groups, run))
    saved_bias = resumed.expert_bias if resumed else None
    run.balance = attach_expert_bias(cfg, run.engine.model, world.device, saved_bias, _sum_over_ranks(world))
    if run.balance is not None:
        run.parts["expert_bias"] = run.balance
        telemetry.recorder.bias = partial(getattr, run.balance, "table")  # each interval row's bias, read with the rest
    # A weak reference to the model: releasing the engine still frees it.
    take = routing_stats(run.engine.model)
    telemetry.watch_routing(take if dims.coordinates(world.rank)["tp"] == 0 else partial(_count_only, take))


def _close_groups(run: Run, kind: type[BaseException] | None, *_: Any) -> None:
    run.groups.close(run.step, clean=kind is None)


def _count_only(take: Any) -> None:
    """A tp rank but the first: the load read (and reset) as every rank must, not recorded."""
    take()


@dataclass(frozen=True)
class Planned:
    """What `_checked_plan` settled: the config as the plan resolved it, the data, the model
    spec, the teacher (model.teacher) and the layout."""

    cfg: Config
    data: PackedTokens | DataMix
    spec: ModelSpec
    distill: Distill | None
    dims: ParallelDims


def _checked_plan(cfg: Config, world: World, paths: RunPaths, resume_from: Path | None, say: Any) -> Planned:
    """The data, the model spec, the plan (strategy auto resolved) and the layout, and
    whether the checkpoint may be continued: all checked before anything is allocated."""
    data = training_data(cfg, world)
    asked = cfg.train.micro_batch  # what the config says, before a plan or an out-of-memory error changes it
    free, target = defaults.unset(cfg), runtime_target(world)  # the keys the device decides, and the device
    spec = model_spec(cfg, data.vocab_size, data.eos_id)
    groups = dims_for(cfg.parallel, world.world_size).dp_size * cfg.fault_tolerance.groups
    cfg, applied = defaults.before_plan(cfg, target, spec.vocab_size, groups, free)
    if cfg.train.loss_chunk_tokens != spec.loss_chunk_tokens:
        spec = model_spec(cfg, data.vocab_size, data.eos_id)
    if cfg.data.document_mask:  # the attention the FLOPs count: the documents' (models/documents.py)
        spec = with_fields(spec, mean_context=measured_context(data))
    spec.build_meta(cfg.data.seq_len)  # a model.trainable pattern that matches nothing stops here
    distill = distill_spec(cfg, spec)  # model.teacher, checked against the student
    if distill is not None and data.masked:
        raise UserError(
            "model.teacher does not combine with fine-tuning records (data.format prompt_response or chat): the KL to the "
            "teacher is over every position, the prompt's included; accepted: one of the two"
        )
    cfg, notes = plan_run(cfg, world, spec, free, target)  # resolves strategy=auto, the defaults that need a plan
    if spec.loss_compiled != bool(cfg.train.compile and spec.loss_chunk_tokens):  # the plan decided train.compile
        spec = with_fields(spec, loss_compiled=not spec.loss_compiled)  # the chunked loss compiled with the blocks
        distill = distill_spec(cfg, spec)
    notes = [f"defaults: {a}" for a in applied] + notes
    dims = dims_for(cfg.parallel, world.world_size)
    cfg, remembered = oom.remembered(cfg, paths.root, dims.dp_size)  # a smaller micro-batch after an OOM
    notes += remembered
    moe = cfg.model.moe
    if moe is not None and moe.balance == "aux" and (asked == AUTO_MICRO_BATCH or cfg.train.micro_batch != asked):
        notes.append(
            f"note: model.moe.balance=aux counts the experts' load per micro-batch, so this run's numbers follow "
            f"train.micro_batch={cfg.train.micro_batch} ({'after an out-of-memory error' if remembered else 'the plan chose it'}, "
            f"configured: {'auto' if asked == AUTO_MICRO_BATCH else asked}); model.moe.balance=sequence_aux keeps them to the global batch"
        )
    if resume_from is not None:
        notes += check_resume(resume_from, cfg, spec, data.fingerprint, dims.dp_size)
    if world.is_main:
        paths.config.write_text(cfg.to_yaml())
    for line in notes:
        say(line)
    return Planned(cfg, data, spec, distill, dims)


def _resume(ckpt: Path, world: World, engine: Engine, layout: ParamLayout, dims: ParallelDims, say: Any) -> TrainerState:
    """Collective: `ckpt` into the engine, natively or resharded / converted from another
    engine and then verified; its trainer state."""
    state, how = checkpoint.resume_state(ckpt, world, engine, layout, dims.as_dict())
    if how != "native":
        was, now = (
            describe(state.engine, state.world_size, state.parallel),
            describe(engine.name, world.world_size, dims.as_dict()),
        )
        say(f"resume: {ckpt.name} ({was}) {how} onto {now}; verified")
    engine.load_extra_state(state.engine_state)
    return state


def _sum_over_ranks(world: World) -> Any:
    """An in-place sum over every rank, or nothing at world 1: each rank counts its own
    tokens (the ranks of a tp group the same ones: the sum is then tp x the load, whose
    sign against its mean ExpertBias reads, unchanged), and a pipeline stage's ranks only
    the rows of its own layers, zeros elsewhere (models/llama.py)."""
    if world.world_size == 1:
        return lambda tensor: None
    import torch.distributed as dist

    return lambda tensor: dist.all_reduce(tensor)


def per_trained_token(loss: Any, batches: RankBatches, ranks: int) -> Any:
    """The loss of fine-tuning records: each micro-batch's mean over its trained targets,
    weighted so that the step's loss and gradient are the mean over every trained target
    of the step on every rank, as one process would compute it. Engines average their
    micro-batches (/ grad_accum) and the `ranks` the gradient is reduced over (dp, x cp
    whose ranks each hold part of every sample's targets): a micro-batch of c trained
    targets, in a step of N on all ranks, weighs c x grad_accum x ranks / N (0 in a step
    without any)."""

    def weighted(output: Any, targets: torch.Tensor) -> torch.Tensor:
        n = batches.step_tokens
        scale = batches.grad_accum * ranks / n if n else 0.0
        return loss(output, targets) * (trained(targets) * scale)

    return weighted
