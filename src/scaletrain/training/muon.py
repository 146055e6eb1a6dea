"""train.optimizer=muon: torch's Muon for the hidden matrices, AdamW for the rest, as one
optimizer to the engines.

Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) orthogonalises each 2-D weight's
momentum by a few Newton-Schulz iterations; it is defined for the matrices inside the
blocks only, so the embedding, the output head (which Moonlight and torchtitan keep on
AdamW) and the 1-D gains stay on AdamW. One `train.lr` serves both: torch's
`adjust_lr_fn="match_rms_adamw"` scales each matrix's update to AdamW's RMS (Moonlight's
0.2 x sqrt(max(rows, columns))), so Muon takes AdamW's learning rate and weight decay.

The engines hold one optimizer (its param_groups get the schedule's lr, its state_dict is
the checkpoint's): `MuonWithAdamW` is one torch Optimizer whose groups are the two inner
optimizers' own group dicts and whose state is one dict both of them use (keyed by
parameter: each parameter is in one of them), so DCP saves and loads it as any optimizer
and `load_state_dict` hands the loaded groups and state back to the two.

Where it runs (config/schema.py): ddp, with the whole matrices on every rank. Not yet: fsdp
and tensor parallel (each rank holds a shard, and Newton-Schulz needs the whole matrix:
a gather per matrix and step), DeepSpeed (its own Muon), and a mixture of experts (its
stacked experts are 3-D: a batch of matrices torch's Muon does not take).
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch

# Output heads, which stay on AdamW (plain names: the built-in model's, Hugging Face's);
# every embedding table (nn.Embedding: tokens, GPT-2's positions) does too.
HEADS = ("output.weight", "*lm_head.weight")
MUON_MOMENTUM = 0.95  # torch's and Moonlight's


def embedding_tables(model: torch.nn.Module) -> set[int]:
    """The ids of the model's embedding tables (any wrapper's modules included)."""
    return {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters(recurse=False)}


def on_muon(name: str, param: torch.Tensor, tables: set[int]) -> bool:
    """Whether Muon steps this (trainable) parameter: a 2-D matrix that is no embedding table
    (`tables`: embedding_tables) and no output head."""
    return param.ndim == 2 and id(param) not in tables and not any(fnmatch.fnmatchcase(name, p) for p in HEADS)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over the groups marked `muon`, AdamW (`adamw`: the caller's builder) over the rest;
    either may be absent (no hidden matrix trains, or nothing else does)."""

    def __init__(self, groups: list[dict[str, Any]], lr: float, adamw: Any):
        muon_groups, adamw_groups = [g for g in groups if g.get("muon")], [g for g in groups if not g.get("muon")]
        self.inner: list[torch.optim.Optimizer] = []
        if muon_groups:
            self.inner.append(torch.optim.Muon(muon_groups, lr=lr, momentum=MUON_MOMENTUM, adjust_lr_fn="match_rms_adamw"))
        if adamw_groups:
            self.inner.append(adamw(adamw_groups))
        super().__init__([{"params": []}], {})  # a torch Optimizer's hooks and bookkeeping; its groups are set below
        self.param_groups = [g for opt in self.inner for g in opt.param_groups]
        self._share()

    def _share(self) -> None:
        """The inner optimizers' groups are this one's dicts, in order; their state is this one's."""
        at = 0
        for opt in self.inner:
            n = len(opt.param_groups)
            opt.param_groups, at = self.param_groups[at : at + n], at + n
            opt.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is None, "no closure: the engines step once per accumulation window"
        for opt in self.inner:
            opt.step()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state dict: handed back to both
        self._share()
