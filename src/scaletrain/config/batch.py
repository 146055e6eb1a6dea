"""The batch arithmetic: the global batch a run keeps, and the micro-batches that divide it.

An optimizer step consumes `global_batch` sequences: `micro_batch` per rank per forward,
`grad_accum` forwards per rank, on `dp` data-parallel ranks. What a run computes depends
on the global batch only: the loss is the mean over the step's tokens, and accumulation
equals a larger batch up to summation order (tests/test_train_equivalence.py); which
sequences a step takes depends on the global batch only as well (data/loader.py). So the
micro-batch is a memory setting, which the planner may choose (train.micro_batch=auto),
search when nothing fits, or shrink after an out-of-memory error (resilience/oom.py); grad_accum
follows from it.
"""

from __future__ import annotations

from scaletrain.config import AUTO_MICRO_BATCH, Config, TrainConfig
from scaletrain.config.stages import schedule_problem
from scaletrain.errors import UserError


def global_batch(train: TrainConfig, dp: int) -> int:
    """Sequences per optimizer step: train.global_batch, or micro_batch x grad_accum x dp."""
    if train.global_batch is not None:
        return train.global_batch
    if train.micro_batch == AUTO_MICRO_BATCH:  # the config refuses auto without a global batch
        raise ValueError("train.micro_batch=auto without train.global_batch")
    return train.micro_batch * train.grad_accum * dp


def per_rank(train: TrainConfig, dp: int) -> int:
    """Sequences each data-parallel rank takes per step (one UserError if they cannot be even)."""
    g = global_batch(train, dp)
    if g % dp:
        near = sorted({max(dp, g // dp * dp), (g // dp + 1) * dp})
        raise UserError(
            f"train.global_batch={g} cannot be split evenly over {dp} data-parallel ranks; "
            f"accepted: a multiple of {dp}, e.g. {' or '.join(map(str, near))}"
        )
    return g // dp


def micro_batches(n: int, pp: int = 1, schedule: str = "1f1b") -> list[int]:
    """The micro-batches a rank taking `n` sequences per step can run, largest first: the
    divisors of n (grad_accum = n / micro_batch), under a pipeline those whose count of
    micro-batches its schedule takes."""
    return [b for b in range(n, 0, -1) if n % b == 0 and (pp == 1 or schedule_problem(schedule, pp, n // b) is None)]


def settle(cfg: Config, dp: int) -> Config:
    """`cfg` with its global batch fixed at `dp` data-parallel ranks (the configured layout:
    a layout the planner picks later keeps it) and, for a micro-batch given as a number,
    grad_accum following from it. One UserError for a batch that does not divide."""
    t = cfg.train
    n = per_rank(t, dp)
    update: dict[str, int] = {"global_batch": global_batch(t, dp)}
    if t.micro_batch != AUTO_MICRO_BATCH:
        update["grad_accum"] = accumulation(t, n, dp, t.micro_batch)
        if t.global_batch is not None and "grad_accum" in t.model_fields_set and t.grad_accum != update["grad_accum"]:
            raise UserError(
                f"train.grad_accum={t.grad_accum} disagrees with train.global_batch={t.global_batch} / "
                f"(train.micro_batch={t.micro_batch} x {dp} data-parallel ranks) = {update['grad_accum']}; "
                "accepted: no train.grad_accum (it follows from the global batch), or that value"
            )
        problem = (
            schedule_problem(cfg.parallel.pp_schedule, cfg.parallel.pp, update["grad_accum"]) if cfg.parallel.pp > 1 else None
        )
        if problem:
            raise UserError(f"parallel.pp_schedule={cfg.parallel.pp_schedule}: {problem}")
    return cfg.model_copy(update={"train": t.model_copy(update=update)})


def accumulation(train: TrainConfig, n: int, dp: int, micro_batch: int) -> int:
    if n % micro_batch:
        options = ", ".join(map(str, micro_batches(n)[:8]))
        raise UserError(
            f"train.micro_batch={micro_batch} does not divide the {n} sequences each of {dp} data-parallel ranks takes "
            f"per step (train.global_batch={global_batch(train, dp)}); accepted: one of {options}, or auto"
        )
    return n // micro_batch


def with_micro_batch(cfg: Config, dp: int, micro_batch: int, why: str | None) -> Config:
    """`cfg` (global batch settled) at another micro-batch on `dp` ranks: grad_accum grows
    or shrinks so that the global batch stays; `why` is kept as train.batch_choice."""
    t = cfg.train
    grad_accum = accumulation(t, per_rank(t, dp), dp, micro_batch)
    return cfg.model_copy(
        update={"train": t.model_copy(update={"micro_batch": micro_batch, "grad_accum": grad_accum, "batch_choice": why})}
    )


def described(micro_batch: int, grad_accum: int, global_batch: int) -> str:
    return f"train.micro_batch={micro_batch}, train.grad_accum={grad_accum} (global batch {global_batch})"
