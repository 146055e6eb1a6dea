"""checkpoint.async_save: the loop waits only for the copy; the files written in the background
hold the state of the step they belong to (not of a later one), exactly as a synchronous
save writes it; each save's blocking time is an event row in metrics.jsonl."""

from __future__ import annotations

import pytest
import torch

import scaletrain.training.trainer as trainer
from scaletrain import checkpoint
from scaletrain.checkpoint.restore import first_difference
from scaletrain.config import load_config
from scaletrain.telemetry import read_metrics

from helpers.runs import base_overrides, checkpoint_state, metric_rows

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_background_save_writes_the_state_of_its_step(small_dataset, tmp_path):
    runs = {}
    for mode in ("true", "false"):
        runs[mode] = run_dir = tmp_path / f"async_{mode}"
        overrides = [*base_overrides(small_dataset, run_dir, steps=4), "train.micro_batch=2", "checkpoint.every=1"]
        trainer.train(load_config([], [*overrides, "checkpoint.keep=4", f"checkpoint.async_save={mode}"]))
    background, synchronous = runs["true"], runs["false"]
    # Saved while the next steps already changed the weights: same bits as a save that waited.
    for step in (1, 2, 3, 4):
        assert checkpoint.find_problem(background / "checkpoints" / f"step_{step}", checkpoint.manager.ALONE) is None
        assert first_difference(checkpoint_state(background, step), checkpoint_state(synchronous, step)) is None, step
    assert [r["loss"] for r in metric_rows(background)] == [r["loss"] for r in metric_rows(synchronous)]
    for run_dir, is_async in ((background, True), (synchronous, False)):
        events = [r for r in read_metrics(run_dir / "metrics.jsonl", events=True) if r.get("event") == "checkpoint"]
        assert sorted(e["step"] for e in events) == [1, 2, 3, 4] and {e["async"] for e in events} == {is_async}
        assert all(0 < e["blocking_s"] <= e["total_s"] for e in events), events


@pytest.mark.timeout(120)
def test_background_saves_copy_into_the_buffers_of_the_first(tmp_path):
    # The engine keeps its staging memory (engines/torch_engine.py Staging): the second save
    # copies into the CPU buffers the first one made (pinned, on a GPU) instead of new ones,
    # and each checkpoint still holds its own step's weights.
    from scaletrain.config.parallel import dims_for
    from scaletrain.engines import build_engine
    from scaletrain.engines.base import MicroBatch
    from scaletrain.launch.distributed import init_distributed, shutdown
    from scaletrain.models import model_spec
    from scaletrain.optim.optimizers import decay_groups

    world = init_distributed("cpu", None, 60)
    try:
        cfg = load_config([], ["model.preset=tiny", "model.vocab_size=64", "data.seq_len=16", "run.device=cpu"])
        spec = model_spec(cfg, None)
        engine = build_engine(spec, world, dims_for(cfg.parallel, 1), cfg, decay_groups(cfg.train))
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
        batch: list[MicroBatch] = [(tokens[:, :-1], tokens[:, 1:])]
        buffers = []
        for step in (1, 2):
            engine.forward_backward(batch, spec.loss)
            engine.step(1e-2)
            engine.save(tmp_path / f"step_{step}", background=True).result()
            assert engine.staging is not None
            cached = engine.staging._stager._state_dict_stager._cached_storage_mapping  # torch's, keyed by source storage
            buffers.append({id(k): v for k, v in cached.items()})  # held here: no address can be reused
        assert buffers[0] and buffers[1].keys() == buffers[0].keys()
        assert all(buffers[1][k] is buffers[0][k] for k in buffers[0])  # each copied into the first save's buffer
        now = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        saved = [read_dcp_model(tmp_path / f"step_{s}", now) for s in (1, 2)]
        assert all(torch.equal(saved[1][k], now[k]) for k in now) and not all(torch.equal(saved[0][k], now[k]) for k in now)
    finally:
        shutdown(world)


def read_dcp_model(path, like):
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: torch.empty_like(v) for k, v in like.items()}}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["model"]
