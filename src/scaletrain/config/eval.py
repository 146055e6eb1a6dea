"""The config's `eval` section: evaluation during training and `scaletrain eval`. Part of the
one schema in scaletrain/config.py, which re-exports it; kept apart so that each file stays
one read (what an evaluation does: scaletrain/evaluation.py; the held-out documents:
data/heldout.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from scaletrain.config.model import Section
from scaletrain.config.stages import SCHEDULES

# The share of documents held out when evaluation is on and no eval.data is given.
DEFAULT_SPLIT = 0.01
DEFAULT_BATCHES = 8  # eval.batches unset: at most this many global batches per evaluation


# What each kind of task reads from a record (data/tasks.py), and the layouts of the standard
# sets it also reads as they are published: a record's own field names, mapped.
TASK_KINDS = ("multiple_choice", "last_word")
TASK_LAYOUTS = ("default", "hellaswag", "arc", "piqa", "winogrande", "lambada")


class TaskConfig(Section):
    """One downstream task of eval.tasks: a local jsonl file scored by the model's
    log-likelihood (data/tasks.py reads it, training/tasks.py scores it)."""

    name: str = Field(min_length=1)  # the rows' and the plots' name for it
    path: str  # a local .jsonl file, one record per line (nothing is downloaded)
    # multiple_choice: each choice's log-likelihood after the context, accuracy and
    # length-normalised accuracy; last_word: the continuation's greedy exact match and perplexity.
    kind: Literal["multiple_choice", "last_word"]
    # How a record is laid out: default ({"context", "choices", "answer"} or {"context",
    # "continuation"}, renamed by `fields`), or a standard set's own fields as published.
    layout: Literal["default", "hellaswag", "arc", "piqa", "winogrande", "lambada"] = "default"
    # The default layout's names in this file: {"context": "question", "choices": "options", ...}.
    fields: dict[str, str] = Field(default_factory=dict)
    shots: int = Field(0, ge=0)  # solved examples put before each record's context, drawn from the file
    limit: int | None = Field(None, ge=1)  # the first `limit` records (None: all)


class EvalConfig(Section):
    # Steps between evaluations, and one after the last step; 0: off.
    every: int = Field(0, ge=0)
    # Global eval batches per evaluation, each of train.global_batch sequences: the first
    # batches x global_batch windows of the eval stream, the same ones every time. Unset:
    # DEFAULT_BATCHES, or as many as the eval data holds if fewer (said at start); a number
    # the data cannot hold is a one-line error.
    batches: int | None = Field(None, ge=1)
    # Sequences per rank per forward (a memory setting: the loss is the same at any
    # value). Unset: train.micro_batch. Under a pipeline the schedule's own micro-batches run.
    micro_batch: int | None = Field(None, ge=1)
    # Globs of text files (tokenized with the training data's tokenizer) or a directory made
    # by `scaletrain data prepare` with that tokenizer. Empty: held-out training documents.
    data: list[str] = Field(default_factory=list)
    # The fraction of the training data's documents held out: never trained on, evaluated
    # on. Unset: 0.01 when eval.every > 0 and eval.data is empty, else 0 (nothing held out).
    # It decides the training stream, so a resume must keep it (checkpoint/resume.py).
    split: float | None = Field(None, ge=0, lt=1)
    # Downstream tasks scored at each evaluation beside the loss, and by `scaletrain eval`
    # (TaskConfig above; docs/evaluation.md).
    tasks: list[TaskConfig] = Field(default_factory=list)

    @field_validator("data", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _tasks_named_once(self) -> EvalConfig:
        names = [t.name for t in self.tasks]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"eval.tasks names {', '.join(twice)} more than once; accepted: one name per task")
        return self

    @model_validator(mode="after")
    def _held_out_or_given(self) -> EvalConfig:
        if self.split is None:
            # Resolved here, so the run's config.yaml records what the training stream
            # skipped. Set past pydantic's assignment, which would count it among the fields
            # the user set: `split_given` tells a resume whether to keep the checkpoint's.
            object.__setattr__(self, "split", DEFAULT_SPLIT if self.every > 0 and not self.data else 0.0)
        split = self.held_out
        if split > 0 and self.data:
            raise ValueError(
                f"eval.split={split:g} and eval.data={self.data} both say what to evaluate on; accepted: one of "
                "them (eval.data: another corpus, and training keeps every document)"
            )
        if self.every > 0 and split == 0 and not self.data:
            raise ValueError(
                f"eval.every={self.every} needs data to evaluate on, but eval.split=0 holds no document out; accepted: "
                f"eval.split in (0, 1) (default {DEFAULT_SPLIT}), eval.data=PATHS, or eval.every=0"
            )
        return self

    @property
    def split_given(self) -> bool:
        """Whether eval.split was set (a YAML file, an override, a saved config.yaml) rather
        than resolved from eval.every and eval.data: a resume keeps the checkpoint's split
        where it was not (training/startup.py, checkpoint_to_resume)."""
        return "split" in self.model_fields_set

    @property
    def held_out(self) -> float:
        """The resolved eval.split: the fraction of documents training skips."""
        return self.split or 0.0


def eval_problem(eval_cfg: EvalConfig, pp: int, schedule: str) -> str | None:
    """A combination of the eval section with the layout that cannot run, or None."""
    if pp > 1 and eval_cfg.micro_batch is not None:
        return (
            f"eval.micro_batch={eval_cfg.micro_batch} with parallel.pp={pp}: a pipeline evaluates with its schedule's "
            "own micro-batches (train.micro_batch, the shapes its stages were built for); accepted: no eval.micro_batch"
        )
    if pp > 1 and SCHEDULES[schedule][2] == "v":
        # Checked with torch 2.13: its runtime runs the V schedules' backward actions in eval
        # too, and the hand-over between a rank's two adjacent stages then fails
        # (AssertionError: can't steal_bwd_input if this stage doesn't have backward).
        loops = [name for name, (_, _, shape) in SCHEDULES.items() if shape != "v"]
        return (
            f"evaluation with parallel.pp_schedule={schedule}: torch 2.13's eval path of the V-shaped schedules fails; "
            f"accepted: parallel.pp_schedule={'|'.join(loops)} (a checkpoint reshards onto any), or eval.every=0"
        )
    return None
