"""Turn text files into token shards plus a manifest, the one input format training reads.

Layout of a prepared directory (made by `prepare_dataset`):
  tokenizer.json            the tokenizer (trained here, or a copy of the one given)
  shard_00000.bin, ...      raw little-endian numpy arrays of token ids (uint16/uint32)
  shard_00000.crc32, ...    each shard's CRC-32 per 64 KiB block (checked by ranged reads, data/remote.py)
  manifest.json             written last; lists every shard with its size and sha256

Documents are tokenized in input order, each followed by the EOS token, and the resulting
stream is cut into shards of exactly `shard_tokens` tokens (the last one shorter). A document
MAY be split across a shard boundary: the loader treats the shards as one continuous stream,
so splitting costs nothing and keeps every shard full.

Fine-tuning records (data.format prompt_response or chat, data/finetune.py) are written as
uint32 with CONTEXT_BIT set on the tokens that are context, not trained (the prompt, the
chat's other turns); the manifest then says "loss_mask": true and the loader turns those
tokens' targets into the ignored index. One stream, one file per shard: the held-out split,
mixtures and packing carry the mark without knowing of it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scaletrain.data.blocks import BLOCK_BYTES, block_checksums, is_url
from scaletrain.data.finetune import chat_template
from scaletrain.data.sources import (
    ACCEPTED,
    MANIFEST,
    SUFFIXES,
    default_corpus_files,
    default_corpus_globs,
    expand_inputs,
    file_format,
    iter_documents,
)
from scaletrain.errors import UserError

__all__ = [
    "MANIFEST",
    "default_corpus_files",
    "default_corpus_globs",
    "ensure_prepared",
    "expand_inputs",
    "prepare_dataset",
    "resolve_dataset_dir",
]

TOKENIZER_FILE = "tokenizer.json"
FORMAT = "scaletrain.tokens"
FORMAT_VERSION = 1
EOS_TOKEN = "<|endoftext|>"
# A tokenizer brought by the user may spell its end-of-document token differently.
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")
_ENCODE_BATCH_DOCS = 512
_ENCODE_BATCH_CHARS = 8 << 20  # bounds memory per encode_batch call for huge documents
CONTEXT_BIT = 1 << 31  # on a token of a fine-tuning record that is not trained (uint32 shards)


# ----------------------------------------------------------------------------- tokenizer


def _train_tokenizer(docs: Iterator[str], vocab_size: int) -> Any:
    """Byte-level BPE: every byte is in the alphabet, so any text encodes without <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its own bar would fight with the rich one
    )
    # BPE training in tokenizers 0.23 is deterministic for identical input (checked across
    # processes); the input order is fixed because the files are sorted.
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def tokenizer_file(path: str | Path) -> Path:
    """A tokenizer.json, given as the file or as the model directory that holds it."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise UserError(
            f"data.tokenizer: {str(path)!r} not found; accepted: a Hugging Face tokenizer.json file, or a directory holding one"
        )
    return p


def _load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    path = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise UserError(f"data.tokenizer: {str(path)!r} is not a valid tokenizer.json ({e})") from None


def _eos_id(tok: Any, source: str) -> tuple[int, str]:
    for name in EOS_CANDIDATES:
        tid = tok.token_to_id(name)
        if tid is not None:
            return int(tid), name
    raise UserError(f"tokenizer {source!r} has no end-of-document token; accepted: one of {', '.join(EOS_CANDIDATES)}")


def _vocab_size(tok: Any) -> int:
    # Ids need not be contiguous in a foreign tokenizer: size the embedding by the largest id.
    return max(tok.get_vocab_size(with_added_tokens=True), max(tok.get_vocab(with_added_tokens=True).values()) + 1)


# ----------------------------------------------------------------------------- writing


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _ShardWriter:
    """Appends token arrays to fixed-size shard files, hashing while writing."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, eos_id: int):
        self.out, self.dtype, self.shard_tokens, self.eos_id = out, dtype, shard_tokens, eos_id
        self.shards: list[dict[str, Any]] = []
        self._documents = 0  # documents ended (EOS written) so far: where a token's document is found
        self._fh: Any = None
        self._hash: Any = None
        self._count = 0

    def write(self, arr: np.ndarray) -> None:
        arr = arr.astype(self.dtype, copy=False)
        while arr.size:
            if self._fh is None:
                name = f"shard_{len(self.shards):05d}.bin"
                self._fh, self._hash, self._count = (self.out / name).open("wb"), hashlib.sha256(), 0
                self.shards.append({"file": name, "tokens": 0, "sha256": "", "documents_before": self._documents})
            n = min(arr.size, self.shard_tokens - self._count)
            self._documents += int(np.count_nonzero(arr[:n] == self.eos_id))
            data = arr[:n].astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
            self._fh.write(data)
            self._hash.update(data)
            self._count += n
            arr = arr[n:]
            if self._count == self.shard_tokens:
                self._finish()

    def close(self) -> None:
        if self._fh is not None:
            self._finish()

    def _finish(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())  # shards are durable before the manifest names them
        self._fh.close()
        self.shards[-1].update(tokens=self._count, sha256=self._hash.hexdigest())
        self._fh = None
        # Each BLOCK_BYTES block's CRC-32 beside the shard: a reader of byte ranges (object
        # storage, data/remote.py) checks what it read without reading the whole shard.
        name = self.shards[-1]["file"]
        sums = self.out / name.replace(".bin", ".crc32")
        with sums.open("wb") as fh:
            fh.write(block_checksums((self.out / name).read_bytes()))
            fh.flush()
            os.fsync(fh.fileno())
        self.shards[-1]["blocks"] = sums.name


def _progress(show: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)  # stdout stays clean for machine-readable output
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("files  {task.fields[tokens]:,} tokens"),
        TimeElapsedColumn(),
        console=console,
        # Not on a terminal (a log, a pipe) a live display leaves its last frame behind as a
        # stray line, e.g. before the one line of an error.
        disable=not show or not console.is_terminal,
    )


def prepare_dataset(
    inputs: Sequence[str | Path],
    out_dir: Path,
    *,
    vocab_size: int = 4096,
    tokenizer: str | None = None,
    text_field: str = "text",
    shard_tokens: int = 1 << 22,
    show_progress: bool = True,
    fmt: str = "auto",
) -> Path:
    """Tokenize `inputs` (globs or file paths) into `out_dir`; returns `out_dir`.

    Built in a temporary sibling directory and renamed into place at the end, so `out_dir`
    either does not exist or is complete; a killed run leaves only a `.NAME.tmp-*` sibling.
    """
    out_dir = Path(out_dir)
    if (out_dir / MANIFEST).exists():
        raise UserError(
            f"{out_dir} already holds a prepared dataset ({MANIFEST}); choose another output directory or delete it first"
        )
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"output {str(out_dir)!r} exists and is not an empty directory; accepted: a new or empty directory")
    if shard_tokens < 1:
        raise UserError(f"shard_tokens = {shard_tokens} is invalid; accepted: an integer >= 1")
    if tokenizer is None and vocab_size < 257:
        raise UserError(f"vocab_size = {vocab_size} is too small; accepted: >= 257 (256 bytes + {EOS_TOKEN})")
    files = expand_inputs(inputs, what="inputs")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 mode would survive the rename; mkdir honours the umask.
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        formats = [file_format(f, fmt, text_field) for f in files]
        manifest = _build(files, formats, tmp, vocab_size, tokenizer, text_field, shard_tokens, show_progress)
        manifest["inputs"] = [str(i) for i in inputs]
        _write_json_durable(tmp / MANIFEST, manifest)
        if out_dir.exists():
            out_dir.rmdir()  # checked empty above; rename() cannot replace a directory
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if (out_dir / MANIFEST).exists():
                raise UserError(f"{out_dir} was prepared by another process at the same time; use it as is") from None
            raise
    except BaseException:  # also KeyboardInterrupt: never leave a half-built temp directory behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _build(
    files: list[Path],
    formats: list[str],
    tmp: Path,
    vocab_size: int,
    tokenizer: str | None,
    text_field: str,
    shard_tokens: int,
    show: bool,
) -> dict[str, Any]:
    masked = any(f != "text" for f in formats)
    template = chat_template(tokenizer_file(tokenizer) if tokenizer else None) if "chat" in formats else None
    with _progress(show) as progress:
        if tokenizer is None:
            # total + 1: the last step is the merge phase after all files are read.
            task = progress.add_task("training tokenizer", total=len(files) + 1, tokens=0)
            docs = iter_documents(files, text_field, lambda: progress.advance(task), formats, template)
            tok = _train_tokenizer((d if isinstance(d, str) else "".join(t for t, _ in d) for d in docs), vocab_size)
            progress.advance(task)
            tok.save(str(tmp / TOKENIZER_FILE))
            source = f"trained here (byte-level BPE, vocab {vocab_size})"
        else:
            tok = _load_tokenizer(Path(tokenizer))
            shutil.copyfile(tokenizer_file(tokenizer), tmp / TOKENIZER_FILE)
            source = str(tokenizer_file(tokenizer).resolve())
        eos_id, eos_token = _eos_id(tok, source)
        vocab = _vocab_size(tok)
        # Ids run 0..vocab-1, so uint16 holds them exactly when vocab <= 65536; the context
        # bit of fine-tuning records needs uint32.
        dtype = np.dtype(np.uint16 if vocab <= 1 << 16 and not masked else np.uint32)

        writer = _ShardWriter(tmp, dtype, shard_tokens, eos_id)
        task = progress.add_task("tokenizing", total=len(files), tokens=0)
        per_file = [0]  # each input file's documents, in order: where a document came from

        def file_done() -> None:
            progress.advance(task)
            per_file.append(0)

        total = documents = trained = 0
        eos = np.array([eos_id], dtype=np.int64)

        def flush(batch: list[Any]) -> None:
            nonlocal total, documents, trained
            # Each piece on its own (a document of plain text is one piece, trained).
            pieces = [[(d, True)] if isinstance(d, str) else d for d in batch]
            # add_special_tokens=False: a foreign tokenizer's BOS/post-processing is not wanted
            # inside a packed stream; documents are separated by EOS alone (chat templates
            # write their own special tokens as text).
            encs = iter(tok.encode_batch([t for p in pieces for t, _ in p], add_special_tokens=False))
            parts: list[np.ndarray] = []
            for p in pieces:
                for _, train in p:
                    ids = np.asarray(next(encs).ids, dtype=np.int64)
                    parts.append(ids if train else ids | CONTEXT_BIT)
                    trained += ids.size if train else 0
                parts.append(eos)  # trained: where a response ends is learnt
            arr = np.concatenate(parts)
            writer.write(arr)
            total += arr.size
            trained += len(pieces)
            documents += len(batch)
            progress.update(task, tokens=total)

        batch: list[Any] = []
        chars = 0
        for doc in iter_documents(files, text_field, file_done, formats, template):
            per_file[-1] += 1
            batch.append(doc)
            chars += len(doc) if isinstance(doc, str) else sum(len(t) for t, _ in doc)
            if len(batch) >= _ENCODE_BATCH_DOCS or chars >= _ENCODE_BATCH_CHARS:
                flush(batch)
                batch, chars = [], 0
        if batch:
            flush(batch)
        writer.close()

    if total == 0:
        raise UserError(f"inputs hold no text (all {len(files)} file(s) empty); {ACCEPTED}")
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": _sha256_file(tmp / TOKENIZER_FILE),
        "tokenizer_source": source,
        "vocab_size": vocab,
        "eos_id": eos_id,
        "eos_token": eos_token,
        "dtype": dtype.name,
        "shards": writer.shards,
        "block_bytes": BLOCK_BYTES,
        "total_tokens": total,
        "documents": documents,
        "files": len(files),
        # Provenance (train.spikes names the document a spike's samples came from): each input
        # file's documents, in stream order; each shard's "documents_before" counts the EOS before it.
        "sources": [{"path": str(f), "documents": n} for f, n in zip(files, per_file)],
        "text_field": text_field,
    } | ({"loss_mask": True, "trained_tokens": trained, "formats": sorted(set(formats))} if masked else {})


def _write_json_durable(path: Path, obj: Any) -> None:
    with path.open("w") as fh:
        json.dump(obj, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


# ----------------------------------------------------------------------------- config glue


def _dataset_name(paths: list[str]) -> str:
    """A readable directory name for the cache entry: the first fixed path component."""
    if not paths:
        return "stdlib"
    fixed = []
    for part in Path(paths[0]).parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    last = Path(*fixed) if fixed else Path("data")
    name = last.stem if last.suffix.lower() in SUFFIXES else last.name
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "data"
    return name[:40]


def resolve_dataset_dir(data_cfg: Any, what: str = "data.paths") -> tuple[Any, list[str] | None]:
    """Where the prepared data for `data_cfg` lives, and the inputs to prepare (None: ready).
    `what`: the key its errors name (a data.mix source's own, data/mix.py).

    The cache key covers the resolved files with their sizes and mtimes, so editing or adding
    a file gives a fresh directory instead of silently training on stale shards.
    """
    paths = [str(p) for p in data_cfg.paths]
    if len(paths) == 1 and is_url(paths[0]):
        return paths[0], None  # a prepared directory in object storage (data/remote.py)
    if len(paths) == 1 and Path(paths[0]).expanduser().is_dir():
        d = Path(paths[0]).expanduser()
        if (d / MANIFEST).is_file():
            return d, None
        raise UserError(
            f"{what}: {paths[0]!r} is a directory without {MANIFEST}; use a glob such as '{paths[0].rstrip('/')}/**/*.txt' ({ACCEPTED})"
        )
    inputs = paths or default_corpus_globs()
    files = expand_inputs(inputs, what=what)
    tok_key: Any = None
    if data_cfg.tokenizer is not None:
        tp = tokenizer_file(data_cfg.tokenizer)
        st = tp.stat()
        tok_key = [str(tp.resolve()), st.st_size, st.st_mtime_ns]
    key = {
        "format": FORMAT_VERSION,
        "files": [[str(f), (s := f.stat()).st_size, s.st_mtime_ns] for f in files],
        "vocab_size": data_cfg.vocab_size if data_cfg.tokenizer is None else None,
        "tokenizer": tok_key,
        "text_field": data_cfg.text_field,
        "shard_tokens": data_cfg.shard_tokens,
    } | ({"format": data_cfg.format} if data_cfg.format != "auto" else {})
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return Path(data_cfg.dir) / f"{_dataset_name(paths)}-{fingerprint}", inputs


def ensure_prepared(data_cfg: Any, show_progress: bool = True, what: str = "data.paths") -> Path:
    """Resolve and, if missing, prepare the dataset for `data_cfg`. Call on rank 0 only."""
    out, inputs = resolve_dataset_dir(data_cfg, what)
    if inputs is None or (out / MANIFEST).is_file():
        return out
    try:
        prepare_dataset(
            inputs,
            out,
            vocab_size=data_cfg.vocab_size,
            tokenizer=data_cfg.tokenizer,
            text_field=data_cfg.text_field,
            shard_tokens=data_cfg.shard_tokens,
            show_progress=show_progress,
            fmt=data_cfg.format,
        )
    except UserError:
        if (out / MANIFEST).is_file():  # another process finished the same preparation first
            return out
        raise
    return out


def check_manifest(text: str, path: str) -> dict[str, Any]:
    """A manifest's text (from `path`, for the errors) -> its fields, or a one-line error."""
    try:
        m = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg}); prepare the data again") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise UserError(f"{path}: not a scaletrain token manifest; accepted: a directory made by `scaletrain data prepare`")
    if m.get("version") != FORMAT_VERSION:
        raise UserError(
            f"{path}: manifest version {m.get('version')!r} is not supported; accepted: {FORMAT_VERSION} (prepare the data again)"
        )
    missing = [k for k in ("tokenizer", "vocab_size", "eos_id", "dtype", "shards", "total_tokens") if k not in m]
    if missing:
        raise UserError(f"{path}: manifest lacks {', '.join(missing)}; prepare the data again")
    if m["dtype"] not in ("uint16", "uint32"):
        raise UserError(f"{path}: dtype {m['dtype']!r} is not supported; accepted: uint16, uint32")
    return m
