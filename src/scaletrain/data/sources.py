"""Where documents come from: the default corpus, input globs, and the readers per file type.

Each .txt/.py file is one document, each .jsonl record one, each .parquet row one. Empty and
null texts are not documents. Problems in the user's files are UserErrors that name the file
(and line) and what is accepted.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from scaletrain.data.finetune import ChatTemplate, Pieces, detect_format, record_pieces
from scaletrain.errors import UserError

MANIFEST = "manifest.json"
# .py is read as plain text so the default corpus (stdlib sources) goes through the same path.
TEXT_SUFFIXES = (".txt", ".py")
SUFFIXES = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
ACCEPTED = "accepted: .txt, .jsonl, .parquet files (.py read as text), or a directory made by `scaletrain data prepare`"
# Stdlib parts that are not representative source text (tests, GUI code, py2 converters).
_STDLIB_EXCLUDED = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo"})


def default_corpus_files() -> list[Path]:
    """The embedded default corpus: the running Python's own standard library sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune excluded directories in place: site-packages alone can be far larger than the stdlib.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files)


def default_corpus_globs() -> list[str]:
    """The default corpus as literal file paths (a glob cannot express the exclusions)."""
    return [str(p) for p in default_corpus_files()]


def expand_inputs(inputs: Iterable[str | Path], what: str = "data.paths") -> list[Path]:
    """Globs (recursive `**`) or literal file paths -> resolved files, sorted within each glob.

    Order across globs is the order given; duplicates keep their first position.
    """
    files: list[Path] = []
    seen: set[Path] = set()
    for item in inputs:
        text = str(item)
        p = Path(text).expanduser()
        if p.is_file():  # literal paths first: names with [ ] would not survive glob()
            matched = [p]
        elif p.is_dir():
            raise UserError(
                f"{what}: {text!r} is a directory without {MANIFEST}; use a glob such as '{text.rstrip('/')}/**/*.txt' ({ACCEPTED})"
            )
        else:
            matched = sorted(Path(m) for m in glob.glob(os.path.expanduser(text), recursive=True) if os.path.isfile(m))
        if not matched:
            raise UserError(f"{what}: {text!r} matches no file; {ACCEPTED}")
        for m in matched:
            if m.suffix.lower() not in SUFFIXES:
                raise UserError(
                    f"{what}: {str(m)!r} (from {text!r}) has unsupported type {m.suffix or '(no suffix)'!r}; accepted: {', '.join(SUFFIXES)}"
                )
            r = m.resolve()
            if r not in seen:
                seen.add(r)
                files.append(r)
    return files


def file_format(f: Path, fmt: str, text_field: str) -> str:
    """What `f`'s records are under data.format=`fmt`: text, prompt_response or chat
    (data/finetune.py); auto decides a .jsonl file by its first record."""
    if f.suffix.lower() != ".jsonl":
        if fmt not in ("auto", "text"):
            raise UserError(
                f"data.format={fmt} reads .jsonl records; {str(f)!r} is not one; accepted: .jsonl files, or data.format=text"
            )
        return "text"
    if fmt != "auto":
        return fmt
    with f.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.strip():
                try:
                    return detect_format(json.loads(line), text_field)
                except json.JSONDecodeError:
                    return "text"  # its reader says where and why
    return "text"


def iter_documents(
    files: Sequence[Path],
    text_field: str = "text",
    on_file_done: Callable[[], None] | None = None,
    formats: Sequence[str] | None = None,
    template: ChatTemplate | None = None,
) -> Iterator[str | Pieces]:
    """Every non-empty document of every file, in order: one per .txt file, record or row;
    a fine-tuning record (`formats[i]` of file i: prompt_response or chat) as its pieces."""
    for i, f in enumerate(files):
        suffix = f.suffix.lower()
        form = formats[i] if formats else "text"
        if suffix in TEXT_SUFFIXES:
            text = f.read_text(encoding="utf-8", errors="replace")
            if text:
                yield text
        elif suffix == ".jsonl" and form != "text":
            for lineno, rec in _jsonl_records(f, f"accepted for data.format={form}: one JSON object per line"):
                yield record_pieces(rec, form, template, f"{f}:{lineno}")
        elif suffix == ".jsonl":
            yield from _jsonl_documents(f, text_field)
        elif suffix == ".parquet":
            yield from _parquet_documents(f, text_field)
        else:  # expand_inputs already refuses these; kept for direct callers
            raise UserError(f"{str(f)!r} has unsupported type {suffix!r}; accepted: {', '.join(SUFFIXES)}")
        if on_file_done is not None:
            on_file_done()


def _jsonl_records(f: Path, hint: str) -> Iterator[tuple[int, Any]]:
    with f.open(encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{f}:{lineno}: not valid JSON ({e.msg}); {hint}") from None


def _jsonl_documents(f: Path, field: str) -> Iterator[str]:
    hint = f"accepted: one JSON object per line with a string field {field!r} (set data.text_field to choose it)"
    for lineno, rec in _jsonl_records(f, hint):
        if not isinstance(rec, dict) or field not in rec:
            keys = ", ".join(map(str, rec)) if isinstance(rec, dict) else type(rec).__name__
            raise UserError(f"{f}:{lineno}: record has no field {field!r} (it has: {keys}); {hint}")
        value = rec[field]
        if value is None:  # a null text is an absent document, as in parquet
            continue
        if not isinstance(value, str):
            raise UserError(f"{f}:{lineno}: field {field!r} is {type(value).__name__}, not a string; {hint}")
        if value:
            yield value


def _parquet_documents(f: Path, field: str) -> Iterator[str]:
    import pyarrow as pa  # lazily: only parquet inputs pay for the import
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{f}: not a readable parquet file ({e}); {ACCEPTED}") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise UserError(
            f"{f}: parquet file has no column {field!r} (columns: {', '.join(schema.names)}); set data.text_field to the text column"
        )
    col_type = schema.field(field).type
    if not (pa.types.is_string(col_type) or pa.types.is_large_string(col_type) or pa.types.is_string_view(col_type)):
        raise UserError(f"{f}: column {field!r} has type {col_type}, accepted: a string column")
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        for value in batch.column(0).to_pylist():
            if value:  # nulls and empty strings are not documents
                yield value
