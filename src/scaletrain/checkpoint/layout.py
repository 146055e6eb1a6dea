"""The engine-neutral state's shape: what every format reader fills and every engine loads.

State is Engine.state_dict's layout: {"model": {name: fp32 tensor}, "optim": {"state.<name>.
exp_avg" | ".exp_avg_sq" | ".step": tensor, "param_groups.<name>.<key>": value}}, full
tensors on CPU, plain parameter names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scaletrain.models.params import canonical_name

State = dict[str, dict[str, Any]]


class ParamLayout:
    """Names, shapes and tied aliases of a model's parameters, from its meta-device build:
    what a reader needs where a format stores a tied parameter once or flattens tensors."""

    def __init__(self, model: nn.Module):
        self.shapes: dict[str, torch.Size] = {}
        self.aliases: dict[str, str] = {}  # a tied parameter's later name -> its first name
        self.frozen: set[str] = set()  # no gradient (model.trainable, LoRA's base)
        first: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            name = canonical_name(name)
            self.shapes[name] = p.shape
            if not p.requires_grad:
                self.frozen.add(name)
            if id(p) in first:
                self.aliases[name] = first[id(p)]
            else:
                first[id(p)] = name
