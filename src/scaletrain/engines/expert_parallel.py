"""Expert parallelism (`parallel.ep`) for the built-in mixture of experts, under FSDP2.

The layout follows torchtitan's: ep ranks are carved out of the data-parallel shard ranks
(ParallelDims.ep: dp_shard = dp_shard_mod_ep x ep, ep innermost), and under context
parallel out of dp_shard x cp (ep = ep / cp of dp_shard x every cp rank: the experts see
all the tokens of the sequences they serve; their FSDP mesh dp_shard_mod_ep stays a root
dimension ahead of the flattened ep one, which DTensor needs). Each MoE layer's stacked
expert weights become DTensors sharded on dim 0 over the ep mesh (torch's
distribute_module, before materialization: nothing is ever allocated whole); the layer's
router sends each token slot to the rank holding its expert and back (models/moe.py, with
torch's autograd-aware all_to_all_single). FSDP2 then shards those expert weights over
dp_shard_mod_ep, composing with the ep placement as it does with tensor parallel's (one
2-D DTensor per weight); everything else is sharded over all of dp_shard as without ep.

Gradients. Every rank's loss is the mean over its own tokens, and FSDP averages over its
mesh: for the dense weights that is the mean over all dp ranks. An expert weight's
gradient on its rank already sums the contributions of every ep rank's tokens (the
all-to-all's backward brings them), and FSDP's reduction over dp_shard_mod_ep adds the
rest: the sum over all dp ranks, which must be divided by dp, not by FSDP's mesh size
(dp / ep). Hence set_gradient_divide_factor(dp), as torchtitan does; under context
parallel dp x cp, the factor the dense weights' FSDP mesh (dp_shard x cp) divides by.

Checkpoints. The expert weights keep their global shapes ([experts, ...]) as DTensors, so
DCP saves and reloads them onto any ep and world size (by byte ranges), and the
engine-neutral state gathers them whole like any other weight.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from scaletrain.models.moe import moe_layers


def split_experts(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Each MoE layer's experts split over `ep_mesh` (Shard(0) of every stacked weight) and
    its all-to-all group set; returns the expert modules (each FSDP-sharded on its own)."""
    experts: list[nn.Module] = []
    for layer in moe_layers(model):
        distribute_module(layer.experts, ep_mesh, partition_fn=_shard_dim0)
        layer.ep_group = ep_mesh.get_group()
        experts.append(layer.experts)
    return experts


def _shard_dim0(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(pname, sharded)


def shard_experts(experts: list[nn.Module], mesh: DeviceMesh, dp_size: int, **kwargs: Any) -> None:
    """FSDP2 over the ranks that hold the same experts (dp_shard_mod_ep), before the blocks
    around them are sharded (whose units then leave these weights out); gradients divided
    by the whole data-parallel size (see the module's docstring)."""
    for module in experts:
        local = module.get_parameter("w1").to_local().shape[0]  # type: ignore[attr-defined]  # a DTensor
        # Fewer local experts than ranks to shard them over: shard each expert's weight
        # along its next dimension instead (dim 0 would leave some ranks nothing).
        placement = (lambda _: Shard(1)) if local < mesh.size() else None
        fully_shard(module, mesh=mesh, shard_placement_fn=placement, **kwargs)
        module.set_gradient_divide_factor(float(dp_size))  # type: ignore[operator]
        if mesh.size() > 1 and dist.get_backend(mesh.get_group()) == "gloo":
            # A divide factor other than the mesh size makes FSDP reduce with NCCL's
            # PREMUL_SUM, which gloo lacks: a plain sum, divided after, gives the same mean.
            # Not on a mesh of one rank: there torch 2.13's FSDP divides by the factor while
            # copying the gradient and again after it in sum mode (a gradient halved at ep =
            # dp = 2: tests/test_gradients.py saw it), and it needs no collective anyway.
            module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
