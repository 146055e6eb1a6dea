"""Data: tokenize text into shards (prepare) and serve packed, rank-sharded samples (loader)."""

from scaletrain.data.loader import PackedTokens, RankBatches
from scaletrain.data.prepare import (
    MANIFEST,
    default_corpus_files,
    default_corpus_globs,
    ensure_prepared,
    expand_inputs,
    prepare_dataset,
    resolve_dataset_dir,
)

__all__ = [
    "MANIFEST",
    "PackedTokens",
    "RankBatches",
    "default_corpus_files",
    "default_corpus_globs",
    "ensure_prepared",
    "expand_inputs",
    "prepare_dataset",
    "resolve_dataset_dir",
]
