"""The training loop, in the order of the data flow:
world -> run directory -> data -> plan + layout -> resume checks -> engine -> resume ->
steps (forward_backward, step, metrics, checkpoints) -> summary.
"""

from __future__ import annotations

import gc
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from scaletrain import checkpoint, faults
from scaletrain.checkpoint.neutral import ParamLayout
from scaletrain.config import Config
from scaletrain.data import PackedTokens, RankBatches, ensure_prepared, resolve_dataset_dir
from scaletrain.distributed import World, all_hostnames, init_distributed, rank0_first, shutdown
from scaletrain.engines import build_engine
from scaletrain.errors import UserError
from scaletrain.guards import ReplicaCheck, Watchdog
from scaletrain.models import ModelSpec, distill_spec, model_spec
from scaletrain.nonfinite import NonfiniteGuard, nan_loss
from scaletrain.optim import decay_groups, lr_at, scaled_lr
from scaletrain.parallel import describe, dims_for
from scaletrain.preempt import Preempted, PreemptionWatch
from scaletrain.preflight import plan_run
from scaletrain.rundir import RunPaths, check_resume, resume_point, write_run_info
from scaletrain.saves import Saves
from scaletrain.telemetry import MetricsLog, TrainProgress, print_banner, print_run_summary
from scaletrain.telemetry.session import Telemetry


def train(cfg: Config, console: Console | None = None) -> dict[str, Any]:
    world = init_distributed(cfg.run.device, cfg.parallel.backend, cfg.parallel.timeout_s)
    try:
        return _train(cfg, world, console or Console())
    finally:
        # A DDP model still alive at destroy_process_group intermittently aborts gloo
        # ("terminate called without an active exception"); _train dropped its engine,
        # and this frees what reference cycles still hold before the group goes.
        gc.collect()
        shutdown(world)


def _train(cfg: Config, world: World, console: Console) -> dict[str, Any]:
    main = world.is_main
    paths = RunPaths(Path(cfg.run.dir))
    say = lambda line: console.print(line, highlight=False, soft_wrap=True) if main else None  # noqa: E731
    resume_from = resume_point(cfg.train.resume, paths, world, say)  # the newest whole checkpoint
    dims_for(cfg.parallel, world.world_size)  # a bad layout stops here, before any work
    if main:
        paths.root.mkdir(parents=True, exist_ok=True)

    data = PackedTokens(_prepared_data(cfg, world), cfg.data.seq_len, cfg.train.seed)
    spec: ModelSpec = model_spec(cfg, data.vocab_size)
    spec.build_meta(cfg.data.seq_len)  # a model.trainable pattern that matches nothing stops here
    distill = distill_spec(cfg, spec)  # model.teacher, checked against the student
    cfg, notes = plan_run(cfg, world, spec)  # before any allocation; resolves strategy=auto
    dims = dims_for(cfg.parallel, world.world_size)
    if resume_from is not None:
        notes += check_resume(resume_from, cfg, spec, data.fingerprint)
    if main:
        paths.config.write_text(cfg.to_yaml())
    for line in notes:
        say(line)
    torch.manual_seed(cfg.train.seed)
    engine = build_engine(spec, world, dims, cfg, decay_groups(cfg.train.weight_decay), distill.teacher if distill else None)
    hosts = all_hostnames(world)
    metrics = MetricsLog(paths.metrics, enabled=main)
    step, position, tokens_seen = 0, 0, 0
    layout = ParamLayout(spec.build_meta(cfg.data.seq_len))
    saved: dict[str, Any] = {}
    if resume_from is not None:
        # Natively, or resharded / converted from another engine and then verified.
        trainer_state, how = checkpoint.resume_state(resume_from, world, engine, layout, dims.as_dict())
        if how != "native":
            was = describe(trainer_state["engine"], trainer_state["world_size"], trainer_state.get("parallel"))
            now = describe(engine.name, world.world_size, dims.as_dict())
            say(f"resume: {resume_from.name} ({was}) {how} onto {now}; verified")
        engine.load_extra_state(trainer_state["engine_state"])
        step, position, tokens_seen = trainer_state["step"], trainer_state["data_position"], trainer_state["tokens_seen"]
        saved = trainer_state.get("nonfinite", {})
    metrics.truncate_after(step)
    telemetry = Telemetry(cfg, world, dims.dp_size, hosts, spec.flops_per_token(cfg.data.seq_len), paths.root, metrics, step)
    if main:
        for name, text in engine.checkpoint_files().items():  # e.g. the exact DeepSpeed JSON
            (paths.root / name).write_text(text)
        pipeline = getattr(engine, "pipeline_info", None)
        write_run_info(
            paths, cfg, world, dims, hosts, resume_from, telemetry.run_info() | ({"pipeline": pipeline} if pipeline else {})
        )
        if pipeline:
            stages = " | ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in pipeline["stages"])
            say(
                f"pipeline: {pipeline['schedule']}, {len(pipeline['stages'])} stages of blocks {stages}, "
                f"{pipeline['micro_batches']} micro-batches per step: ranks idle {pipeline['bubble']:.0%} of a step "
                "(the bubble; more micro-batches shrink it)"
            )
    guard = NonfiniteGuard(cfg.train, cfg.precision, world, saved)
    # After this start's first step: torch creates optimizer state lazily, and saving before
    # it exists would create it early (shifting Adam's step count).
    verify_pending = cfg.checkpoint.verify_on_start

    global_batch = cfg.train.micro_batch * cfg.train.grad_accum * dims.dp_size
    tokens_per_step = global_batch * cfg.data.seq_len
    peak_lr = scaled_lr(cfg.train, global_batch)
    if main:
        print_banner(console, cfg, world, spec, data.samples_per_epoch, tokens_per_step, global_batch, peak_lr, resume_from)

    batches = RankBatches(
        data, cfg.train.micro_batch, cfg.train.grad_accum, dims.dp_rank(world.rank), dims.dp_size, start=position
    )
    saves = Saves(cfg, world, dims, engine, spec, data, paths, guard, metrics, layout)
    progress = TrainProgress(console, cfg.train.steps, step, cfg.train.log_every, enabled=main)
    watch = PreemptionWatch(world)
    replicas = ReplicaCheck(world, engine.name, cfg.guards.weight_hash_every, hosts, dims)
    watchdog = Watchdog(world, paths.root, cfg.guards.hang_timeout_s, say=lambda line: print(line, file=sys.stderr, flush=True))
    started, start_step = time.perf_counter(), step
    run_loss = distill.loss if distill else spec.loss  # with a teacher, the loss takes both outputs
    slow = faults.slowdown("compute")
    try:
        while step < cfg.train.steps:
            t0 = time.perf_counter()
            lr = lr_at(step, cfg.train, peak_lr)
            loss_fn = nan_loss(run_loss) if faults.fire_once("nan", step + 1) else run_loss
            loss_fn = faults.slowed(loss_fn, slow) if slow else loss_fn
            with telemetry.step(step + 1) as mark:
                batch = batches.next_step()
                mark("data")
                loss = engine.forward_backward(batch, loss_fn, mark)
                stats = engine.step(lr)  # a non-finite step is not applied, whatever the policy
                mark("optimizer")
            step += 1
            watchdog.beat(step)
            tokens_seen += tokens_per_step
            roll_back = guard.check(loss, stats.grad_norm, step, saves.newest)
            dt = time.perf_counter() - t0
            telemetry.record(
                loss,
                stats.grad_norm,
                step=step,
                lr=lr,
                tokens_per_s=tokens_per_step / dt,
                step_time_s=dt,
                tokens=tokens_seen,
                **({"loss_scale": stats.loss_scale, "skipped": stats.skipped} if stats.loss_scale else {}),
                **guard.counters(),
            )
            if roll_back:
                telemetry.flush()
                with watchdog.paused():
                    step, tokens_seen = saves.roll_back(say)
                metrics.truncate_after(step)  # the rows of the undone steps; the counters keep the tally
                progress.advance(step)
                continue
            progress.advance(step)
            faults.preempt_at(step, received=lambda: watch.signum != 0)
            stop = watch.agreed()  # a preemption signal on any rank stops all after this step
            save_now = stop or step == cfg.train.steps or (cfg.checkpoint.every > 0 and step % cfg.checkpoint.every == 0)
            if save_now or step % cfg.train.log_every == 0:
                progress.show(telemetry.flush())
            if replicas.due(step):
                _check_replicas(replicas, step, engine, telemetry, say)
            if faults.fire_once("perturb", step):
                faults.perturb(engine.model)
            if faults.armed("hang", step):
                faults.hang_forever()
            if save_now:
                with watchdog.paused():  # a long save (or the wait for the previous one) is no hang
                    saves.save(step, batches.position, tokens_seen)
            saves.poll()
            if faults.armed("step", step):
                saves.wait()  # the point is "after step N and its checkpoint"; `save` kills mid-save
            faults.kill_at("step", step)
            if verify_pending:
                with watchdog.paused():
                    saves.verify_round_trip(step, batches.position, tokens_seen)
                say(f"checkpoint: verify_on_start saved and reloaded step {step}: every tensor came back exactly")
                verify_pending = False
            if stop:
                watchdog.close()
                saves.wait()
                raise Preempted(step, signal.Signals(stop).name)
        watchdog.close()
        saves.wait()  # the last checkpoint is complete before the run says it finished
    except UserError:
        watchdog.close()
        saves.wait()  # a clean stop, agreed by every rank: the save in flight still completes
        raise
    finally:
        watchdog.close()
        telemetry.close()
        watch.close()
        progress.close()
        # An exception's traceback keeps this frame's locals alive; the engine (a DDP
        # wrapper, say) must not outlive the process group (see train()).
        del engine, saves

    summary = {
        "run_dir": str(paths.root),
        "steps": step,
        "steps_this_run": step - start_step,
        "elapsed_s": time.perf_counter() - started,
    }
    if main:
        print_run_summary(console, paths, summary, resume_from)
    return summary


def _check_replicas(replicas: ReplicaCheck, step: int, engine: Any, telemetry: Telemetry, say: Any) -> None:
    event = replicas.check(step, engine.model.parameters())
    if event is not None:
        telemetry.event(event)  # every check while they differ; said once
    if event is not None and replicas.first_seen == step:
        say(
            f"warning: replicas hold different {event['what']} at step {step}: rank(s) {event['ranks']} "
            f"on {', '.join(sorted(set(event['hosts'])))} differ from the others (guards.weight_hash_every)"
        )


def _prepared_data(cfg: Config, world: World) -> Path:
    # Every rank validates the paths (same error everywhere); rank 0 alone tokenizes.
    resolve_dataset_dir(cfg.data)
    rank0_first(
        world,
        lambda: ensure_prepared(cfg.data, show_progress=True),
        "preparing the data",
        cfg.data.prepare_timeout_s,
        hint="accepted: a larger data.prepare_timeout_s, or `scaletrain data prepare` beforehand and data.paths=<its output>",
    )
    return resolve_dataset_dir(cfg.data)[0]
