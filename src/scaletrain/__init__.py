"""scaletrain: plan, run, watch and recover distributed LLM training."""

import os
import sys

__version__ = "0.1.0"

# DeepSpeed JIT-builds its C++ ops into torch's extension cache, one directory per user,
# shared by every checkout and environment, and guarded by a lock file that a killed build
# leaves behind: every later build then waits on it forever (a CI run hung so). Inside a
# virtual environment the cache lives in it instead, beside the torch the ops are compiled
# against; `make setup` fills it and clears locks that no live build holds
# (engines/deepspeed_ops.py). An explicit TORCH_EXTENSIONS_DIR wins.
if sys.prefix != sys.base_prefix:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
