"""Data: tokenize text into shards (prepare) and serve packed, rank-sharded samples (loader)."""

from scaletrain.data.loader import PackedTokens, RankBatches
from scaletrain.data.mix import DataMix, MixShares, mix_to_prepare, open_mix, prepare_mix, tokens_dir
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
    "DataMix",
    "MixShares",
    "PackedTokens",
    "RankBatches",
    "default_corpus_files",
    "default_corpus_globs",
    "ensure_prepared",
    "expand_inputs",
    "mix_to_prepare",
    "open_mix",
    "prepare_mix",
    "prepare_dataset",
    "resolve_dataset_dir",
    "tokens_dir",
]
