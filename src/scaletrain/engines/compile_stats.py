"""What torch.compile did in this process (train.compile): the numbers a run shows so that
a graph break or a recompilation is seen, not guessed from a slower step.

  graphs        graphs dynamo captured (a compiled block's forward: one per kind of block,
                grad mode and micro-batch shape; docs/engines.md says which a run makes)
  graph_breaks  graph breaks (0 under compile_blocks' fullgraph=True, where one is an error)
  recompiles    compilations of a function that dynamo had compiled before: a guard failed
                (grad mode, a new shape, another kind of block running the same code)

Read from torch._dynamo's own counters: process-wide and cumulative since the process
started. None where dynamo was never imported, so a run
without compile neither pays for the import nor shows the numbers.
"""

from __future__ import annotations

import sys


def compile_counters() -> dict[str, int] | None:
    """{"graphs", "graph_breaks", "recompiles"} so far, or None without dynamo loaded."""
    utils = sys.modules.get("torch._dynamo.utils")
    convert = sys.modules.get("torch._dynamo.convert_frame")
    if utils is None or convert is None:
        return None
    counters = utils.counters
    # Compilations per frame (one code object's frame state): the first is a compile,
    # every later one a recompile. Private to torch (2.13): absent, recompiles read 0.
    per_frame = getattr(convert, "FRAME_COMPILE_COUNTER", {})
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": int(sum(max(0, n - 1) for n in per_frame.values())),
    }
