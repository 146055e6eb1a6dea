"""Selective activation checkpointing (`parallel.ac_mode=selective`): which of a block's
operations keep their outputs for backward and which are recomputed there.

torchtitan's per-op policy (its default for Llama 3 8B): a checkpointed block saves the
outputs of the expensive operations, the attention kernel's, a reduce-scatter's (sequence
parallel's), an amax's (float8's scales) and every other matrix product's (the first, the
third, ...: about half of the products' FLOPs, half their output bytes), and recomputes the
rest in backward: the other products and all the memory-bound work (norms, rotary, the
activation function, residuals, casts). Against full checkpointing (every operation again)
the recompute is about half the products' time and the memory-bound work's; against none it
keeps the block's input and those outputs, not every tensor the backward reads.

One rule, read by both sides: the engines wrap each block with `context()` (torch's
`create_selective_checkpoint_contexts`), and the planner's trace (planning/clock/trace.py)
walks the traced forward through `saves()` in the same order, for the bytes a block keeps
and the operations its backward repeats.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# The operations whose outputs are kept, by their overload packet's name (aten.mm's "mm",
# c10d's "reduce_scatter_tensor"), the attention kernels of every backend SDPA picks (CPU too).
SAVED = frozenset(
    {
        "mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "reduce_scatter_tensor",
        "max",
    }
)


def _name(func: Any) -> str:
    """An operation's name without its namespace and overload: "mm" for aten.mm.default, as an
    OpOverload or as the planner's trace writes it ("aten.mm.default")."""
    if isinstance(func, str):
        parts = func.split(".")
        return parts[1] if len(parts) > 1 else parts[0]
    return func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)


class Counter:
    """One pass's matrix products counted in order: every second one is recomputed."""

    def __init__(self) -> None:
        self.mm = 0

    def saves(self, func: Any) -> bool:
        """Whether `func`'s output is kept (called once per operation, in the pass's order);
        `func` an OpOverload or its name as the planner's trace writes it."""
        name = _name(func)
        if name == "mm":
            self.mm += 1
            return self.mm % 2 == 1
        return name in SAVED


def context() -> tuple[Any, Any]:
    """The context pair torch.utils.checkpoint's `context_fn` returns: a forward and its
    recompute each count their own products, so both keep the same ones."""
    counters: dict[bool, Counter] = defaultdict(Counter)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        keep = counters[ctx.is_recompute].saves(func)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
