"""Downstream tasks (eval.tasks) from local jsonl files: their records read, checked and
turned into the (context, continuation) pairs a model scores by log-likelihood, tokenized
with the run's tokenizer. Torch-free; training/tasks.py scores them.

Two kinds, as lm-evaluation-harness defines them:
  multiple_choice  each choice's log-likelihood as the continuation of the context; the
                   answer is the likeliest choice (`acc`), or the likeliest per character
                   of the choice (`acc_norm`, which does not favour short choices)
  last_word        the continuation's log-likelihood and whether greedy decoding produces
                   it exactly (`acc`; LAMBADA's last word), and the perplexity over items

A record's layout: by default {"context": str, "choices": [str, ...], "answer": int} or
{"context": str, "continuation": str}, its names mapped by the task's `fields`; or a
standard set's own fields as published (hellaswag, arc, piqa, winogrande, lambada). A
choice or continuation follows its context after one space (lm-evaluation-harness's target
delimiter), except where a layout says otherwise. Few-shot examples (`shots`) are other
records of the same file, solved and put before the context, "\n\n" between them; drawn by
a generator seeded with the task's name and the record's index, so every run, world size
and rank draws the same ones.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scaletrain.config.eval import TaskConfig
from scaletrain.errors import UserError

TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"


@dataclass(frozen=True)
class Item:
    """One record: a context and continuation per choice (multiple choice shares the context
    and varies the continuation; winogrande the reverse; last_word has one of each)."""

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    answer: int  # the correct choice's index (last_word: 0)
    chars: tuple[int, ...]  # each choice's length in characters, for acc_norm

    def solved(self) -> str:
        """The record as a few-shot example: its context and its answer."""
        return self.contexts[self.answer] + self.continuations[self.answer]


@dataclass(frozen=True)
class Request:
    """One pair to score: `tokens` is context then continuation (the context cut from the
    left to fit the window), of which the last `scored` are the continuation's."""

    item: int
    choice: int
    tokens: tuple[int, ...]
    scored: int


def load_items(task: TaskConfig) -> list[Item]:
    """The task's records as Items, few-shot examples in their contexts; one-line UserErrors
    naming the file, the record and what is accepted."""
    path = Path(task.path).expanduser()
    if not path.is_file():
        raise UserError(f"eval.tasks {task.name}: {path} is not a file; accepted: a local .jsonl file, one record per line")
    records = _records(path, task)
    read = _LAYOUTS[task.layout]
    items = [read(record, task, f"{path} record {i + 1}") for i, record in enumerate(records)]
    if task.shots >= len(items):
        raise UserError(
            f"eval.tasks {task.name}: shots={task.shots} but {path} holds {len(items)} record(s), and a record is not "
            f"its own example; accepted: shots <= {len(items) - 1}"
        )
    if task.limit is not None:
        scored = range(min(task.limit, len(items)))
    else:
        scored = range(len(items))
    return [_with_shots(items, i, task) for i in scored]


def _records(path: Path, task: TaskConfig) -> list[dict[str, Any]]:
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"eval.tasks {task.name}: {path} is not UTF-8 text; accepted: a .jsonl file") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(
                f"eval.tasks {task.name}: {path} line {n} is not JSON ({e.msg}); accepted: one JSON object per line"
            ) from None
        if not isinstance(record, dict):
            raise UserError(f"eval.tasks {task.name}: {path} line {n} is not a JSON object; accepted: one JSON object per line")
        records.append(record)
    if not records:
        raise UserError(f"eval.tasks {task.name}: {path} holds no record; accepted: one JSON object per line")
    return records


def _with_shots(items: list[Item], i: int, task: TaskConfig) -> Item:
    if task.shots == 0:
        return items[i]
    others = [j for j in range(len(items)) if j != i]
    shots = random.Random(f"{task.name}:{i}").sample(others, task.shots)
    prefix = "".join(items[j].solved() + FEWSHOT_DELIMITER for j in shots)
    item = items[i]
    return Item(tuple(prefix + c for c in item.contexts), item.continuations, item.answer, item.chars)


def _field(record: dict[str, Any], name: str, task: TaskConfig, where: str, kind: type | tuple[type, ...]) -> Any:
    key = task.fields.get(name, name)
    if key not in record:
        raise UserError(
            f"eval.tasks {task.name}: {where} has no field {key!r} (its fields: {', '.join(sorted(record)) or 'none'}); "
            f"accepted: a record with it, or eval.tasks' fields mapping {name!r} to the file's name for it"
        )
    value = record[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        wanted = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise UserError(f"eval.tasks {task.name}: {where} field {key!r} is {type(value).__name__}; accepted: {wanted}")
    return value


def _choices(context: str, choices: list[Any], answer: Any, task: TaskConfig, where: str) -> Item:
    """A multiple-choice item of one context; checks the choices and the answer's range."""
    if task.kind != "multiple_choice":
        raise UserError(f"eval.tasks {task.name}: layout {task.layout} is multiple choice; accepted: kind=multiple_choice")
    if not choices or not all(isinstance(c, str) for c in choices):
        raise UserError(
            f"eval.tasks {task.name}: {where} has {'no choices' if not choices else 'a choice that is not text'}; accepted: a list of two or more strings"
        )
    if isinstance(answer, str) and answer.strip().lstrip("-").isdigit():
        answer = int(answer)
    if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
        raise UserError(f"eval.tasks {task.name}: {where} answer {answer!r} is out of range; accepted: 0 to {len(choices) - 1}")
    return Item(
        tuple(context for _ in choices), tuple(TARGET_DELIMITER + c for c in choices), answer, tuple(len(c) for c in choices)
    )


def _default(record: dict[str, Any], task: TaskConfig, where: str) -> Item:
    context = _field(record, "context", task, where, str)
    if task.kind == "last_word":
        continuation = _field(record, "continuation", task, where, str)
        if not continuation.strip():
            raise UserError(f"eval.tasks {task.name}: {where} has an empty continuation; accepted: text to score")
        return Item((context,), (TARGET_DELIMITER + continuation,), 0, (len(continuation),))
    return _choices(
        context, _field(record, "choices", task, where, list), _field(record, "answer", task, where, (int, str)), task, where
    )


def _hellaswag_text(text: str) -> str:
    # The set's scraped text as lm-evaluation-harness cleans it: WikiHow's "[title]" marks as
    # sentence ends, other bracketed marks dropped, double spaces closed.
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(record: dict[str, Any], task: TaskConfig, where: str) -> Item:
    ctx_b = _field(record, "ctx_b", task, where, str)
    ctx = _field(record, "ctx_a", task, where, str) + " " + ctx_b.capitalize()
    context = _hellaswag_text(_field(record, "activity_label", task, where, str) + ": " + ctx)
    endings = [_hellaswag_text(e) if isinstance(e, str) else e for e in _field(record, "endings", task, where, list)]
    return _choices(context, endings, _field(record, "label", task, where, (int, str)), task, where)


def _arc(record: dict[str, Any], task: TaskConfig, where: str) -> Item:
    question = _field(record, "question", task, where, str)
    choices = _field(record, "choices", task, where, dict)
    texts, labels = choices.get("text"), choices.get("label")
    if not isinstance(texts, list) or not isinstance(labels, list) or len(texts) != len(labels):
        raise UserError(
            f"eval.tasks {task.name}: {where} choices is not {{text: [...], label: [...]}} of equal lengths; accepted: ARC's layout"
        )
    key = _field(record, "answerKey", task, where, str)
    if key not in labels:
        raise UserError(
            f"eval.tasks {task.name}: {where} answerKey {key!r} is not one of its labels {labels}; accepted: one of them"
        )
    return _choices(f"Question: {question}\nAnswer:", texts, labels.index(key), task, where)


def _piqa(record: dict[str, Any], task: TaskConfig, where: str) -> Item:
    goal = _field(record, "goal", task, where, str)
    solutions = [_field(record, "sol1", task, where, str), _field(record, "sol2", task, where, str)]
    return _choices(f"Question: {goal}\nAnswer:", solutions, _field(record, "label", task, where, (int, str)), task, where)


def _winogrande(record: dict[str, Any], task: TaskConfig, where: str) -> Item:
    """The blank filled with each option is the context; what follows the blank is the one
    continuation (partial scoring): acc only, the continuation being the same for both."""
    if task.kind != "multiple_choice":
        raise UserError(f"eval.tasks {task.name}: layout winogrande is multiple choice; accepted: kind=multiple_choice")
    sentence = _field(record, "sentence", task, where, str)
    if "_" not in sentence:
        raise UserError(f"eval.tasks {task.name}: {where} sentence has no '_' blank; accepted: Winogrande's layout")
    options = [_field(record, "option1", task, where, str), _field(record, "option2", task, where, str)]
    answer = _field(record, "answer", task, where, (int, str))
    answer = int(answer) - 1 if str(answer).strip() in ("1", "2") else -1
    if answer < 0:
        raise UserError(f"eval.tasks {task.name}: {where} answer is not 1 or 2; accepted: Winogrande's '1' or '2'")
    blank = sentence.index("_")
    rest = TARGET_DELIMITER + sentence[blank + 1 :].strip()
    return Item(tuple(sentence[:blank] + o for o in options), (rest, rest), answer, (len(rest), len(rest)))


def _lambada(record: dict[str, Any], task: TaskConfig, where: str) -> Item:
    if task.kind != "last_word":
        raise UserError(f"eval.tasks {task.name}: layout lambada is a last word; accepted: kind=last_word")
    text = _field(record, "text", task, where, str).rstrip()
    if " " not in text:
        raise UserError(f"eval.tasks {task.name}: {where} text is one word; accepted: a passage and its last word")
    context, word = text.rsplit(" ", 1)
    return Item((context,), (" " + word,), 0, (len(word),))


_LAYOUTS: dict[str, Callable[[dict[str, Any], TaskConfig, str], Item]] = {
    "default": _default,
    "hellaswag": _hellaswag,
    "arc": _arc,
    "piqa": _piqa,
    "winogrande": _winogrande,
    "lambada": _lambada,
}


def requests(items: list[Item], encode: Callable[[str], list[int]], window: int, prefix: int, task: str) -> list[Request]:
    """Each item's pairs as token requests of at most `window` + 1 tokens (the model sees the
    first `window`). The continuation's tokens are those of context + continuation after the
    context's, as lm-evaluation-harness splits a pair (where a token joins across the
    boundary, after the tokens both agree on); a context's trailing whitespace goes to the
    continuation. An empty context is
    `prefix` (the end-of-text token). A continuation longer than the window: one line."""
    out = []
    for i, item in enumerate(items):
        for c, (context, continuation) in enumerate(zip(item.contexts, item.continuations, strict=True)):
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            if context:
                head, whole = encode(context), encode(context + continuation)
                # Where a token joins across the boundary, the pair splits where the two agree.
                k = next((j for j, (a, b) in enumerate(zip(head, whole)) if a != b), min(len(head), len(whole)))
                head, ours = whole[:k], whole[k:]
            else:
                head, ours = [prefix], encode(continuation)
            if not ours:
                raise UserError(
                    f"eval.tasks {task}: record {i + 1} choice {c} tokenizes to nothing; accepted: a non-empty continuation"
                )
            if len(ours) > window:
                raise UserError(
                    f"eval.tasks {task}: record {i + 1} choice {c} is {len(ours)} tokens, more than data.seq_len={window}; "
                    "accepted: a shorter continuation, or a longer data.seq_len"
                )
            tokens = (head + ours)[-(window + 1) :]
            out.append(Request(i, c, tuple(tokens), len(ours)))
    return out
