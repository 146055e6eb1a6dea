"""Whether the current config may continue a checkpoint, and what changed since it.

A change that alters what the saved state or the data position mean is refused: the
model's shape (the saved tensors would not fit, or mean something else), the tokens
(another corpus, tokenizer or shard layout, a mixture's weights: the data fingerprint), data.seq_len (another
set of windows) and train.seed (another order of them). Anything else (steps, learning
rate, logging, checkpointing, precision, batch layout, world size where the engine
supports it) is allowed and reported, one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from scaletrain.checkpoint.frozen_base import check_base
from scaletrain.checkpoint.state import TrainerState
from scaletrain.config import Config
from scaletrain.config.model import MoeSection
from scaletrain.errors import UserError

# Config keys that change the meaning of the data position (besides the fingerprint):
# eval.split decides which documents the training stream skips (data/heldout.py).
_DATA_KEYS = ("data.seq_len", "train.seed", "eval.split")
# Keys that are not settings of the run (where it lives; what auto chose last time).
_IGNORED = ("run.dir", "train.resume", "parallel.auto_choice", "train.batch_choice")


def check_config(path: Path, cfg: Config, saved_state: TrainerState, model: dict[str, Any], data_fingerprint: str) -> list[str]:
    """Raise a one-line UserError for a change that breaks the checkpoint at `path`; return
    the allowed changes as 'key old -> new' strings."""

    def refuse(key: str, old: Any, new: Any, why: str) -> UserError:
        return UserError(
            f"{key} is {new!r} but checkpoint {path} was trained with {old!r} ({why}); "
            f"accepted: {key}={old!r} to resume it, or a new run.dir (or train.resume=never there)"
        )

    saved_model = saved_state.model
    if ("distill_proj" in saved_model) != ("distill_proj" in model):  # the hidden-state term's projection
        had = "with" if "distill_proj" in saved_model else "without"
        raise UserError(
            f"checkpoint {path} was trained {had} model.teacher.hidden_weight (its projection distill_proj is "
            f"{'' if had == 'with' else 'not '}in the saved weights); accepted: the same setting to resume it, or a new run.dir"
        )
    for key, old in saved_model.items():
        if model.get(key) != old:
            where = "model.moe" if key in MoeSection.model_fields else "model"  # the key as the config spells it
            raise refuse(f"{where}.{key}", old, model.get(key), "the saved weights have its shape")
    # A key the checkpoint's version did not have yet: it ran as the key's default says.
    saved_cfg = _flatten(Config().model_dump(mode="json")) | _flatten(yaml.safe_load((path / "config.yaml").read_text()))
    now = _flatten(cfg.model_dump(mode="json"))
    if saved_state.data_fingerprint != data_fingerprint:
        # A mixture's fingerprint covers its sources and weights (data/mix.py).
        key = "data.mix" if saved_cfg.get("data.mix") or now.get("data.mix") else "data.paths"
        what = "other tokens or weights" if key == "data.mix" else "other tokens"
        raise refuse(key, saved_cfg.get(key), now.get(key), f"{what}: the data position would point elsewhere")
    if (saved_cfg.get("model.trainable") or []) != (now.get("model.trainable") or []):
        raise refuse(
            "model.trainable",
            saved_cfg.get("model.trainable") or [],
            now.get("model.trainable"),
            "its optimizer state holds exactly the parameters it trained",
        )
    if saved_cfg.get("train.optimizer", "adamw") != now.get("train.optimizer"):
        raise refuse(
            "train.optimizer", saved_cfg.get("train.optimizer", "adamw"), now.get("train.optimizer"),
            "its optimizer state is that optimizer's: a run changes optimizer only on a fresh start",
        )  # fmt: skip
    if saved_state.base is not None:  # its frozen parameters come from the base this run builds: the same one?
        check_base(path, saved_state.base, cfg)
    for key in _DATA_KEYS:
        if saved_cfg.get(key) != now.get(key):
            if key == "eval.split" and not cfg.eval.split_given and not saved_cfg.get(key):
                # The default split of eval.every > 0 over a run that held nothing out: eval.split=0
                # would not do (nothing to evaluate on), so the accepted ways are other ones.
                raise UserError(
                    f"eval.every={cfg.eval.every} holds {100 * cfg.eval.held_out:g}% of the documents out by default, but checkpoint "
                    f"{path} trained on all of them (eval.split=0: the data position would point elsewhere); accepted: "
                    "eval.data=PATHS (evaluate on other text), or a new run.dir"
                )
            raise refuse(key, saved_cfg.get(key), now.get(key), "the data position would point elsewhere")
    return [
        f"{key} {saved_cfg.get(key)!r} -> {now.get(key)!r}"
        for key in sorted(set(saved_cfg) | set(now))
        if saved_cfg.get(key) != now.get(key) and key not in _IGNORED
    ]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "deepspeed_extra":
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
