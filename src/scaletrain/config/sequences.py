"""Where the long-sequence settings are offered: parallel.cp (both designs), train.tile_tokens
and train.activation_offload. Without torch: config/schema.py asks `long_sequence_problem`
once the whole config is known (models/capabilities.py then asks each model at build)."""

from __future__ import annotations

from typing import Any

from scaletrain.config.model import MOE_PRESETS
from scaletrain.config.sources import SOURCES
from scaletrain.strategies import TABLE, names_where, said


def long_sequence_problem(cfg: Any) -> str | None:
    """The one-line refusal of a long-sequence setting this config cannot run, or None."""
    return _context_parallel_problem(cfg) or _tiles_and_offload_problem(cfg)


def _context_parallel_problem(cfg: Any) -> str | None:
    par, m, seq = cfg.parallel, cfg.model, cfg.data.seq_len
    if par.cp == 1:
        return None
    if not (par.strategy in TABLE and TABLE[par.strategy].cp):
        where = said(names_where(lambda r: r.cp))
        why = TABLE[par.strategy].no_cp_why if par.strategy in TABLE else "auto chooses cp itself: leave parallel.cp at 1"
        return (
            f"parallel.cp={par.cp} needs parallel.strategy={where}, not {par.strategy} ({why}); accepted: "
            f"parallel.strategy={where}, or parallel.cp=1"
        )
    if par.cp_mode == "ulysses" and seq % par.cp:
        return (
            f"parallel.cp={par.cp} with cp_mode=ulysses cuts each sequence into cp equal runs; data.seq_len={seq} does not "
            f"divide; accepted: data.seq_len a multiple of {par.cp}"
        )
    if par.cp_mode == "allgather" and seq % (2 * par.cp):
        return (
            f"parallel.cp={par.cp} cuts each sequence into 2 x cp = {2 * par.cp} equal chunks (rank i holds chunks i and "
            f"{2 * par.cp - 1} - i: even causal work); data.seq_len={seq} does not divide; accepted: data.seq_len a "
            f"multiple of {2 * par.cp}"
        )
    experts = m.moe is not None or m.preset in MOE_PRESETS
    unchecked = [
        (par.pp > 1, f"parallel.pp={par.pp}", "parallel.pp=1", "a pipeline passes whole sequences between stages"),
        (par.cp_mode not in SOURCES[m.source].cp_modes, f"model.source={m.source}",
         "the built-in model, or a Hugging Face one with cp_mode=ulysses", "its attention takes the whole sequence"),
        (experts and bool(m.moe and m.moe.capacity_factor), f"model.moe.capacity_factor={m.moe and m.moe.capacity_factor}",
         "model.moe.capacity_factor=0 (dropless)", "a capacity counts each rank's part of the sequences, not the whole"),
        (par.dp_replicate > 1, f"parallel.dp_replicate={par.dp_replicate}", "parallel.dp_replicate=1", "not checked yet"),
        # Ulysses compiles (tests/test_gradients.py); all-gather's chunked causal mask is a
        # torch.nn.attention.bias.CausalBias, which dynamo does not trace (fullgraph: an error).
        (cfg.train.compile and par.cp_mode == "allgather", "train.compile=true", "train.compile=false, or parallel.cp_mode=ulysses",
         "the all-gather design's chunked causal mask, a CausalBias, does not trace under torch.compile"),
    ]  # fmt: skip
    for bad, given, accepted, why in unchecked:
        if bad:
            return f"parallel.cp={par.cp} does not combine with {given} ({why}); accepted: {accepted}, or parallel.cp=1"
    return None


def _tiles_and_offload_problem(cfg: Any) -> str | None:
    par, m, t = cfg.parallel, cfg.model, cfg.train
    unchecked = [(par.pp > 1, f"parallel.pp={par.pp}"), (t.compile, "train.compile=true")]
    for key, on, off in (("activation_offload", t.activation_offload, "false"), ("tile_tokens", t.tile_tokens, "0")):
        for bad, given in unchecked if on else []:
            if bad:
                return f"train.{key} does not combine with {given} (not checked yet); accepted: train.{key}={off}"
    if t.tile_tokens and m.teacher is not None:
        return "train.tile_tokens does not combine with model.teacher (its loss needs the whole logits); accepted: train.tile_tokens=0"
    if t.tile_tokens and not SOURCES[m.source].tiles:
        return (
            f"train.tile_tokens tiles the built-in model's feed-forward, experts and loss, not model.source={m.source}'s "
            "(not built yet); accepted: train.tile_tokens=0"
        )
    if t.tile_tokens and m.moe is not None and m.moe.capacity_factor:
        return (
            f"train.tile_tokens does not combine with model.moe.capacity_factor={m.moe.capacity_factor} (a capacity "
            "keeps each expert's first slots of the whole micro-batch, not of a tile); accepted: "
            "model.moe.capacity_factor=0 (dropless), or train.tile_tokens=0"
        )
    return None
