"""The optimizers (train.optimizer, optim/registry.py: AdamW here, Muon beside AdamW in
muon.py, schedule-free AdamW in schedule_free.py), built by their entry's builder, and their
default parameter groups (decay on matrices only)."""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils import _foreach_utils

from scaletrain.config import TrainConfig
from scaletrain.errors import UserError
from scaletrain.models.params import canonical_name, embedding_tables, on_muon
from scaletrain.optim.registry import optimizer as entry_of


def decay_groups(train: TrainConfig) -> Callable[[nn.Module], list[dict[str, Any]]]:
    """The parameter groups (engines.ParamGroups): every trainable parameter, with decoupled
    weight decay on matrices only (norm gains, 1-D, are not decayed: decaying them pulls
    activations toward zero); then each train.param_groups entry takes the parameters its
    patterns match first, at its learning-rate multiplier (the group's lr_scale) and weight
    decay. Without entries: the two default groups, as every earlier run had them."""

    def groups(model: nn.Module) -> list[dict[str, Any]]:
        # Plain names, whatever wraps the model (DDP's module., checkpointing, compile).
        named = [(canonical_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
        taken = _matched(train.param_groups, [n for n, _ in named])
        tables = embedding_tables(model) if entry_of(train.optimizer).splits_matrices else None
        buckets: dict[tuple[int, bool, bool], list[nn.Parameter]] = {}
        for name, p in named:
            muon = tables is not None and on_muon(name, p, tables)
            buckets.setdefault((taken.get(name, -1), p.ndim >= 2, muon), []).append(p)
        out = []
        for index in range(-1, len(train.param_groups)):
            entry = train.param_groups[index] if index >= 0 else None
            for matrix, stepped_by_muon in ((True, True), (True, False), (False, False)):
                decay = train.weight_decay if matrix else 0.0
                if entry is not None and entry.weight_decay is not None:
                    decay = entry.weight_decay
                group: dict[str, Any] = {"params": buckets.get((index, matrix, stepped_by_muon), []), "weight_decay": decay}
                if entry is not None:
                    group["lr_scale"] = entry.lr
                if stepped_by_muon:
                    group["muon"] = True  # optim/muon.py: Muon steps this group, AdamW the others
                out.append(group)
        # No empty group: where only matrices train (LoRA adapters, attention projections),
        # torch's flattened optimizer state cannot be loaded back into an optimizer with an
        # empty group (state_dict._unflatten_optim_state_dict indexes its first parameter).
        return [g for g in out if g["params"]]

    return groups


def _matched(entries: list[Any], names: list[str]) -> dict[str, int]:
    """Each name's first matching entry of train.param_groups; a pattern that matches no
    trainable parameter is a one-line UserError naming some real names."""
    taken: dict[str, int] = {}
    for i, entry in enumerate(entries):
        for pattern in entry.match:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise UserError(
                    f"train.param_groups[{i}].match pattern {pattern!r} matches no trainable parameter; accepted: glob "
                    f"patterns over names such as {', '.join(repr(n) for n in (names[0], names[len(names) // 2], names[-1]))}"
                )
            for name in hits:
                taken.setdefault(name, i)
    return taken


def describe_groups(optimizer: torch.optim.Optimizer) -> list[str]:
    """One line per optimizer group, for the start of a run: its size, learning-rate
    multiplier and weight decay."""
    muon = any(g.get("muon") for g in optimizer.param_groups)
    return [
        f"optimizer group {i}: {sum(p.numel() for p in g['params']):,} parameters in {len(g['params'])} tensors, "
        f"{('Muon, ' if g.get('muon') else 'AdamW, ') if muon else ''}lr x {g.get('lr_scale', 1.0):g}, "
        f"weight_decay {g['weight_decay']:g}"
        for i, g in enumerate(optimizer.param_groups)
    ]


def group_lrs(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each optimizer group's learning rate as the last step set it (engines' set_lr: the
    schedule's x the group's lr_scale), numbered as describe_groups prints them, for the
    interval rows (metrics.jsonl) and diagnose's plot."""
    muon = any(g.get("muon") for g in optimizer.param_groups)
    return [
        {
            "group": i,
            "optimizer": ("muon" if g.get("muon") else "adamw") if muon else None,
            "lr_scale": g.get("lr_scale", 1.0),
            "lr": float(g["lr"]),
        }
        for i, g in enumerate(optimizer.param_groups)
    ]


def build_adamw(groups: list[dict[str, Any]], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """torch's AdamW, fused where torch has the kernel for the parameters' device (CUDA and
    CPU among them): one kernel over all tensors instead of a dozen ops per tensor (on this
    project's CPU 6x faster than foreach, docs/gpu.md), and the only implementation that
    takes the non-finite flag into the kernel (skip_where): a skipped step needs no host sync."""
    fused = device.type in _foreach_utils._get_fused_kernels_supported_devices()
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=fused or None)


def build_optimizer(groups: list[dict[str, Any]], cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """train.optimizer, by its registry entry's builder (optim/registry.py), in training mode."""
    module, function = entry_of(cfg.optimizer).builder.split(":")
    optimizer: torch.optim.Optimizer = getattr(importlib.import_module(module), function)(groups, cfg, device)
    training_weights(optimizer)
    return optimizer


def after_load(optimizer: torch.optim.Optimizer) -> None:
    """A load restores each group's `fused` with its state (skip_where follows the groups);
    GradScaler follows the optimizer's flag instead, set when it was built: made to agree."""
    optimizer._step_supports_amp_scaling = all(g.get("fused") for g in optimizer.param_groups)  # type: ignore[attr-defined]


# Schedule-free optimizers (optim/schedule_free.py) step one sequence of weights and evaluate
# another, an average: the parameters hold the first while training and the second while the
# model is evaluated or saved (the schedulefree package's train() and eval(), its groups'
# `train_mode`). A checkpoint is saved, so loaded, in the evaluation mode, and stays so until
# the next forward that trains (the engines call training_weights): what a load restored is
# then read back exactly (resume's verification), and every run switches at the same steps, so
# a resumed run continues bit for bit. A plain torch optimizer has no modes: nothing changes.
def has_modes(optimizer: Any) -> bool:
    return callable(getattr(optimizer, "eval", None)) and callable(getattr(optimizer, "train", None))


def _training(optimizer: torch.optim.Optimizer) -> bool:
    return all(g.get("train_mode", True) for g in optimizer.param_groups)


def training_weights(optimizer: Any) -> None:
    """The training weights in the parameters (before a forward that trains)."""
    if has_modes(optimizer) and not _training(optimizer):
        _switch(optimizer.train, optimizer)


@contextmanager
def averaged(optimizer: Any) -> Iterator[None]:
    """The optimizer's evaluation weights in the parameters for the block (an evaluation, a
    save); the mode it found after it."""
    if not has_modes(optimizer) or not _training(optimizer):
        yield
        return
    _switch(optimizer.eval, optimizer)
    try:
        yield
    finally:
        _switch(optimizer.train, optimizer)


def _switch(mode: Callable[[], None], optimizer: torch.optim.Optimizer) -> None:
    """train() or eval(), less the empty state entries they leave: the package reads
    `self.state[p]`, a defaultdict, for every parameter, and torch's DCP initialises an
    optimizer's state before a load only where it has none (state_dict._init_optim_state):
    with an entry per parameter it skipped that, found no state names to load, and a resume
    came back without z or the second moment."""
    mode()
    for p in [p for p, state in optimizer.state.items() if not state]:
        del optimizer.state[p]


def skip_where(optimizer: torch.optim.Optimizer, skipped: torch.Tensor) -> None:
    """optimizer.step(), applied nowhere when `skipped` (a 0-d bool on the device) is set:
    weights, both moments and the step count stay exactly as they were. A fused optimizer
    takes the flag into its kernel as GradScaler's found_inf, which it checks on the
    device (and takes the step count back); another one reads the flag: one host sync.
    Fused or not is each group's own: a resumed checkpoint of a foreach optimizer (an
    earlier scaletrain's on a CPU) keeps its implementation, so it continues bit for bit."""
    if not all(group.get("fused") for group in optimizer.param_groups):
        if not skipped:
            optimizer.step()
        return
    optimizer.found_inf = skipped.float()  # type: ignore[attr-defined]
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
