"""The config's `data` section: what a run trains on (data.paths, or a mixture of sources
by weight, data.mix). Part of the one schema in scaletrain/config.py, which re-exports it;
kept apart so that each file stays one read (preparing: data/prepare.py; the mixture's
sample stream: data/mix.py).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from scaletrain.config.model import Section


class MixSource(Section):
    """One source of data.mix; weights are relative (0.7 and 0.3, or 7 and 3)."""

    paths: list[str]
    weight: float

    @field_validator("paths", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class DataConfig(Section):
    # Globs of .txt/.jsonl/.parquet files, or a directory made by `scaletrain data prepare`.
    # Empty: the embedded default, the Python standard library's own source files.
    paths: list[str] = Field(default_factory=list)
    seq_len: int = Field(128, ge=8)
    dir: str = "data"  # where prepared shards and the locally trained tokenizer are cached
    vocab_size: int = Field(4096, ge=257, le=1_000_000)  # for a tokenizer trained here
    tokenizer: str | None = None  # an existing tokenizer.json instead of training one
    text_field: str = "text"  # the field holding the text in .jsonl/.parquet records
    # Tokens per shard file. Shards are what an epoch reorders, so the default keeps even
    # the 3M-token embedded corpus in several of them.
    shard_tokens: int = Field(1 << 20, ge=1024)
    # Rank 0 alone tokenizes; the other ranks wait this long for it (not in a collective,
    # so a big corpus never trips the process-group timeout).
    prepare_timeout_s: float = Field(7200.0, gt=0)
    # data.paths as a URL (s3://bucket/prefix: a prepared directory in object storage, read
    # range by range, data/remote.py): blocks kept up to cache_bytes in memory, and under
    # cache_dir on disk as well (the same bound) where given.
    cache_dir: str | None = None
    cache_bytes: int = Field(256 << 20, ge=1 << 16)
    # A mixture instead of paths: [{paths: [...], weight: 0.7}, ...], each source prepared as
    # data.paths is, all with one tokenizer, interleaved by weight (data/mix.py, docs/data.md).
    mix: list[MixSource] = Field(default_factory=list)
    # Inside a packed sample, attention stops at each document's end and positions restart
    # at its start (models/documents.py; the built-in model).
    document_mask: bool = False
    # What a .jsonl record is: text (data.text_field), prompt_response ({"prompt", "response"}:
    # the loss on the response only), chat ({"messages": [{"role", "content"}, ...]}: the
    # loss on the assistant's turns), or auto (each file by its first record's fields).
    format: Literal["auto", "text", "prompt_response", "chat"] = "auto"

    @field_validator("paths", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _mix_or_paths(self) -> DataConfig:
        # Checked here, not with Field constraints, so each line names the source by its place.
        if self.mix and self.paths:
            raise ValueError(
                f"data.mix and data.paths={self.paths} both say what to train on; "
                "accepted: one of them (each source's paths go inside data.mix)"
            )
        for i, source in enumerate(self.mix):
            if not source.paths:
                raise ValueError(
                    f"data.mix[{i}].paths is empty; accepted: globs of .txt/.jsonl/.parquet, or a prepared directory"
                )
            if not (math.isfinite(source.weight) and source.weight > 0):
                raise ValueError(f"data.mix[{i}].weight = {source.weight:g} is invalid; accepted: a finite number > 0")
        return self
