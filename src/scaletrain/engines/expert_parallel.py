"""Expert parallelism (`parallel.ep`) under FSDP2, for a mixture of experts: the built-in
one, or transformers' stacked experts (models/hf_experts.py).

The layout follows torchtitan's: ep ranks are carved out of the data-parallel shard ranks
(ParallelDims.ep: dp_shard = dp_shard_mod_ep x ep, ep innermost), and under context
parallel out of dp_shard x cp (ep = ep / cp of dp_shard x every cp rank: the experts see
all the tokens of the sequences they serve; their FSDP mesh dp_shard_mod_ep stays a root
dimension ahead of the flattened ep one, which DTensor needs). Each MoE layer's stacked
expert weights become DTensors sharded on dim 0 over the ep mesh (torch's
distribute_module, before materialization: nothing is ever allocated whole; the model's
spec does it, ExpertSplit.split_experts: models/moe.py for the built-in layers,
models/hf_experts.py for transformers' stacked experts); the layer's router sends each
token slot to the rank holding its expert and back (models/moe.py `exchange_slots`, with
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
from torch.distributed.tensor import Shard


def shard_experts(experts: list[nn.Module], mesh: DeviceMesh, dp_size: int, **kwargs: Any) -> None:
    """FSDP2 over the ranks that hold the same experts (dp_shard_mod_ep; under hybrid
    sharding replicated over dp_replicate too), before the blocks
    around them are sharded (whose units then leave these weights out); gradients divided
    by the whole data-parallel size (see the module's docstring)."""
    for module in experts:
        local = next(module.parameters()).to_local().shape[0]  # type: ignore[attr-defined]  # a DTensor: this rank's experts
        # Fewer local experts than ranks to shard them over: shard each expert's weight
        # along its next dimension instead (dim 0 would leave some ranks nothing).
        placement = (lambda _: Shard(1)) if local < mesh.shape[-1] else None  # hybrid: (replicate, shard)
        fully_shard(module, mesh=mesh, shard_placement_fn=placement, **kwargs)
        module.set_gradient_divide_factor(float(dp_size))  # type: ignore[operator]
        if mesh.shape[-1] > 1 and dist.get_backend(mesh.get_all_groups()[0]) == "gloo":
            # A divide factor other than the mesh size makes FSDP reduce with NCCL's
            # PREMUL_SUM, which gloo lacks: a plain sum, divided after, gives the same mean.
            # Not where the shard dimension is one rank (the mesh's last: hybrid sharding's is
            # (dp_replicate, dp_shard_mod_ep)): there torch 2.13's FSDP divides by the factor
            # while copying the gradient and again after it in sum mode (a gradient halved at
            # ep = dp = 2: tests/test_gradients.py saw it; an expert gradient halved at
            # dp_replicate 2 x ep 2 on world 4: test_moe.py's hybrid test).
            module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
