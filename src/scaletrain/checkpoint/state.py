"""What a checkpoint says about the run besides the engine's state: trainer.json, typed.

One dataclass, one reader (`TrainerState.read`) and one writer (`to_json`, written by
checkpoint/manager.py); everything else asks its fields. The file carries a format
version. A trainer.json without one was written before this class existed (scaletrain
main up to ec9befa, whose checkpoints tests/fixtures/main_step2 keeps); it is read as
version 1, whose fields it has (its "scheduler" entry, a copy of the step, is dropped).
A newer version than this code knows is refused in one line: its fields may mean more
than this version would restore.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from scaletrain.errors import UserError

FILE = "trainer.json"
VERSION = 1


@dataclass
class TrainerState:
    step: int  # optimizer steps done
    data_position: int  # the global sample index where step + 1 starts (data/loader.py)
    tokens_seen: int
    world_size: int  # of the run that wrote it: RNG streams belong to ranks
    parallel: dict[str, int]  # its layout (ParallelDims.as_dict()): how the state is cut
    # The stamp: what state/ is (strategies.FORMATS) and which strategy wrote it. Read on
    # resume before anything is allocated.
    format: str
    engine: str
    model: dict[str, Any]  # the model spec's config(): what fixes the tensors' shapes
    data_fingerprint: str  # of the token shards: the data position means these tokens
    engine_state: dict[str, Any] = field(default_factory=dict)  # small engine extras (the loss scaler)
    nonfinite: dict[str, int] = field(default_factory=dict)  # resilience/nonfinite.py's counters
    # checkpoint.frozen=reference: where the frozen parameters left out of state/ come
    # from (checkpoint/frozen_base.py); None when state/ holds every parameter.
    base: dict[str, Any] | None = None
    # model.moe.balance=bias: each MoE layer's expert bias [layers][experts] (models/moe.py
    # ExpertBias), model state that no engine holds; None without one.
    expert_bias: list[list[float]] | None = None
    # Telemetry's running totals (telemetry/session.py): the device-hours so far, which cost is
    # computed from; None in checkpoints written before (their resume reads metrics.jsonl's).
    telemetry: dict[str, float] | None = None
    # train.spikes (resilience/spikes.py): its trailing window, recent spikes and lowered rate;
    # None without the guard, and in checkpoints written before.
    spikes: dict[str, Any] | None = None
    # `scaletrain ckpt convert`: the checkpoint this one was converted from (path, engine, world size).
    converted_from: dict[str, Any] | None = None
    version: int = VERSION

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, indent=1)

    @classmethod
    def from_dict(cls, saved: dict[str, Any], where: str = FILE) -> TrainerState:
        version = saved.get("version", 1)
        if not isinstance(version, int) or version > VERSION:
            raise UserError(
                f"{where} is trainer state version {version!r}, written by a newer scaletrain; accepted: version "
                f"{VERSION} or older (upgrade scaletrain to resume it)"
            )
        if "format" not in saved or "engine" not in saved:
            raise UserError(f"checkpoint {where} has no format stamp (written by an older scaletrain); accepted: a new run.dir")
        known = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in saved and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise UserError(f"{where} lacks {', '.join(missing)}; accepted: a trainer.json written by scaletrain")
        return cls(**{k: v for k, v in saved.items() if k in known} | {"version": VERSION})

    @classmethod
    def read(cls, ckpt: Path) -> TrainerState:
        """The trainer state of the checkpoint directory `ckpt`."""
        path = ckpt / FILE
        try:
            saved = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path} is unreadable ({type(e).__name__}); accepted: a checkpoint written by scaletrain") from None
        if not isinstance(saved, dict):
            raise UserError(f"{path} is not a JSON object; accepted: a checkpoint written by scaletrain")
        return cls.from_dict(saved, str(path))
