"""`scaletrain data prepare`: files tokenized into the token shards `train` reads."""

from __future__ import annotations

import argparse
from pathlib import Path

from scaletrain.config import DataConfig


def add_parser(sub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    d = sub.add_parser(name, help="dataset tools")
    actions = d.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = actions.add_parser(
        "prepare",
        help="tokenize .txt/.jsonl/.parquet files into token shards + manifest",
        description="Tokenize files into numpy token shards with a manifest (tokenizer, counts, checksums).",
    )
    prep.add_argument("--input", nargs="+", required=True, metavar="GLOB", help="files or globs (.txt, .jsonl, .parquet)")
    prep.add_argument(
        "--out", required=True, metavar="DIR", help="output directory or URL (s3://bucket/prefix; must not hold a dataset yet)"
    )
    defaults = DataConfig()
    prep.add_argument("--vocab-size", type=int, default=defaults.vocab_size, help="BPE vocabulary size when training a tokenizer")
    prep.add_argument(
        "--tokenizer",
        metavar="TOKENIZER",
        help="use this tokenizer.json (or a model directory holding one) instead of training one",
    )
    prep.add_argument("--text-field", default="text", help="field holding the text in .jsonl/.parquet records")
    prep.add_argument(
        "--format",
        default="auto",
        choices=["auto", "text", "prompt_response", "chat"],
        help=".jsonl records: text, prompt/response or chat messages (loss on responses only); auto: by their fields",
    )
    prep.add_argument("--shard-tokens", type=int, default=defaults.shard_tokens, help="tokens per shard file")
    return d


def run(args: argparse.Namespace) -> int:
    """`prepare`, the one action."""
    import tempfile

    from scaletrain.data import prepare_dataset  # numpy, the tokenizers
    from scaletrain.data.blocks import is_url
    from scaletrain.data.remote import upload_dataset

    def prepare(out: Path) -> Path:
        return prepare_dataset(
            args.input,
            out,
            vocab_size=args.vocab_size,
            tokenizer=args.tokenizer,
            text_field=args.text_field,
            shard_tokens=args.shard_tokens,
            fmt=args.format,
        )

    if is_url(args.out):  # object storage: prepared here, then copied there (data/remote.py)
        with tempfile.TemporaryDirectory(prefix="scaletrain-prepare-") as tmp:
            upload_dataset(prepare(Path(tmp) / "data"), args.out)
        print(f"prepared dataset: {args.out} (see {args.out.rstrip('/')}/manifest.json)")
        return 0
    out = prepare(Path(args.out))
    print(f"prepared dataset: {out} (see {out / 'manifest.json'})")
    return 0
