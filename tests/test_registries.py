"""The registries (optim/registry.py, config/sources.py): the config accepts exactly their
names and refuses others in one line naming them; every entry resolves to what the rest of
the package asks of it (a builder that builds, a schedule lr_at follows, a source's module
with its two builders)."""

from __future__ import annotations

import importlib

import pytest
import torch

from scaletrain.config import load_config
from scaletrain.config.sources import SOURCES
from scaletrain.errors import UserError
from scaletrain.models import model_spec
from scaletrain.optim.optimizers import build_optimizer, decay_groups
from scaletrain.optim.registry import OPTIMIZERS, SCHEDULES
from scaletrain.optim.schedule import lr_at

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("key", "table"), [("optimizer", OPTIMIZERS), ("schedule", SCHEDULES)])
def test_the_config_takes_the_registrys_names_and_refuses_others_in_one_line(key, table):
    for name in table:
        assert getattr(load_config([], [f"train.{key}={name}"]).train, key) == name
    with pytest.raises(UserError) as err:
        load_config([], [f"train.{key}=nope"])
    said = str(err.value)
    assert f"train.{key}=nope" in said and "\n" not in said
    assert said.endswith(", ".join(list(table)[:-1]) + f" or {list(table)[-1]}")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_entry_builds_and_steps(name):
    module, function = OPTIMIZERS[name].builder.split(":")
    assert callable(getattr(importlib.import_module(module), function))
    cfg = load_config([], ["model.vocab_size=64", f"train.optimizer={name}"])
    spec = model_spec(cfg, 64)
    model = spec.build_meta(16)
    spec.materialize(model, torch.device("cpu"), seed=0)
    optimizer = build_optimizer(decay_groups(cfg.train)(model), cfg.train, torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randint(0, 64, (2, 16))).float().pow(2).mean().backward()
    optimizer.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()) if p.grad is not None)


def test_every_schedule_warms_up_then_follows_its_entry():
    for name, entry in SCHEDULES.items():
        cfg = load_config([], [f"train.schedule={name}", "train.steps=100", "train.warmup_steps=10", "train.lr=1.0"])
        curve = [lr_at(s, cfg.train) for s in range(100)]
        assert curve[:10] == [(s + 1) / 10 for s in range(10)], name
        decayed = curve[-1] < curve[10]
        assert decayed == (entry.decays_over != "none"), name
        # "last" decays over train.decay_steps only (unset: a fifth of the run): flat until then.
        assert (curve[79] == 1.0) == (entry.decays_over in ("last", "none")), name


def test_every_model_source_names_a_module_that_builds_its_specs_and_others_are_refused():
    for entry in SOURCES.values():
        module = importlib.import_module(entry.module)
        assert callable(module.from_section) and callable(module.from_saved), entry.name
    with pytest.raises(UserError) as err:
        load_config([], ["model.source=jax"])
    assert str(err.value).endswith("model.source=jax is not one scaletrain builds; accepted: builtin|hf|python")
    # A key of another source, named with where this one takes it instead.
    with pytest.raises(UserError, match=r"model.spec_args does not apply to Hugging Face models; accepted: its config"):
        load_config([], ["model.source=hf", "model.path=/m", "model.spec_args={dim: 8}"])
