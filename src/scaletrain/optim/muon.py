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

Where it runs (config/schema.py): ddp, with the whole matrices on every rank, and fsdp,
whose ranks hold each matrix as a shard (a DTensor): Newton-Schulz needs the whole matrix,
so `ShardedMuon` gathers each matrix's update once per step (one all-gather), runs torch's
own iteration on it, and keeps its own rows: every rank computes the same whole-matrix
result as one process, at the price of that gather (the planner counts it) and of every
rank orthogonalising every matrix. Tensor parallel's DTensors gather the same way (fsdp +
tp). A mixture of experts' stacked experts ([experts, rows, columns], 3-D, which torch's
Muon refuses) are a batch of matrices: each expert's matrix is orthogonalised on its own and
its learning rate matched by its own shape, as torch's step would treat it alone. Where a
rank's shard of a stack is whole experts (ep's split, FSDP's Shard(0) over the experts) it
orthogonalises those, with no gather; where FSDP cuts inside the experts (Shard(1): fewer of
a rank's experts than ranks to shard them over) the stack is gathered like any matrix. Not
yet: DeepSpeed (its own Muon).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

# torch's own pieces of its Muon step (private: pinned torch; tests/test_muon.py holds fsdp's
# sharded step at world 2 to torch's own step in one process).
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from scaletrain.optim.optimizers import build_adamw

MUON_MOMENTUM = 0.95  # torch's and Moonlight's


class ShardedMuon(torch.optim.Muon):
    """torch's Muon, whose Newton-Schulz step sees each whole matrix where a parameter is
    held as shards (a DTensor: FSDP2), and each matrix of a 3-D stack on its own. Without
    either it is torch's step unchanged.

    torch's own step would run its iteration on the shards as DTensors, whose matmuls
    redistribute the operands several times per iteration and sum partial products in
    another order than one process does; here one all-gather per matrix and step, and the
    same bf16 iteration as one process on the same matrix (docstring above)."""

    def __init__(self, params: list[dict[str, Any]], **kwargs: Any):
        # torch's __init__ refuses any parameter but a 2-D one (its own step's condition): the
        # stacks join their groups after it, and this class's step takes them.
        groups = [{**g, "params": [p for p in g["params"] if p.ndim == 2]} for g in params]
        super().__init__(groups, **kwargs)
        for group, given in zip(self.param_groups, params):
            group["params"].extend(p for p in given["params"] if p.ndim == 3)
        held = [p for g in self.param_groups for p in g["params"]]
        self.own_step = any(isinstance(p, DTensor) or p.ndim == 3 for p in held)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if not self.own_step:
            return super().step(closure)
        assert closure is None, "no closure: the engines step once per accumulation window"
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            self._init_group(group, params, grads, buffers)  # torch's: the momentum buffers made where missing
            lr, momentum = float(group["lr"]), group["momentum"]
            for param, grad, buffer in zip(params, grads, buffers):
                # torch's _single_tensor_muon, step for step, with the iteration on the whole matrix.
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = _whole_matrix_iteration(update, group)
                param.mul_(1 - lr * group["weight_decay"])
                # A stack's learning rate matched by each matrix's shape (all alike), not the stack's first two sizes.
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape[-2:]))
        return None


def _whole_matrix_iteration(update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """torch's Newton-Schulz iteration on each whole matrix of `update`: a DTensor's is
    gathered once and the result cut back to its placements on every rank alike (no second
    collective), unless its shards are whole matrices already: a stack split along its
    experts only (ep's and FSDP's Shard(0)), whose rank orthogonalises its own."""
    args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
    if isinstance(update, DTensor) and update.ndim == 3 and all(not p.is_shard() or p.dim == 0 for p in update.placements):  # type: ignore[attr-defined]
        done = _each_matrix(update.to_local(), args)
        return DTensor.from_local(done, update.device_mesh, update.placements, shape=update.shape, stride=update.stride())
    whole = update.full_tensor() if isinstance(update, DTensor) else update
    done = _each_matrix(whole, args)
    if not isinstance(update, DTensor):
        return done
    return distribute_tensor(done, update.device_mesh, update.placements, src_data_rank=None)


def _each_matrix(update: torch.Tensor, args: tuple[Any, ...]) -> torch.Tensor:
    if update.ndim == 2:
        return _zeropower_via_newtonschulz(update, *args)
    # A stack of matrices (a mixture of experts' experts): each on its own; a rank's share of
    # the stack may hold none (FSDP's uneven Shard(0) of fewer experts than ranks).
    return torch.stack([_zeropower_via_newtonschulz(m, *args) for m in update]) if len(update) else update.clone()


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over the groups marked `muon`, AdamW (`adamw`: the caller's builder) over the rest;
    either may be absent (no hidden matrix trains, or nothing else does)."""

    def __init__(self, groups: list[dict[str, Any]], lr: float, adamw: Any):
        muon_groups, adamw_groups = [g for g in groups if g.get("muon")], [g for g in groups if not g.get("muon")]
        self.inner: list[torch.optim.Optimizer] = []
        if muon_groups:
            self.inner.append(ShardedMuon(muon_groups, lr=lr, momentum=MUON_MOMENTUM, adjust_lr_fn="match_rms_adamw"))
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


def build(groups: list[dict[str, Any]], cfg: Any, device: torch.device) -> MuonWithAdamW:
    """train.optimizer=muon (optim/registry.py): Muon for the groups decay_groups marked, AdamW
    (optimizers.build_adamw) for the rest."""
    return MuonWithAdamW(groups, cfg.lr, lambda rest: build_adamw(rest, cfg, device))
