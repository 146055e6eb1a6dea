"""trainer.json as a typed, versioned TrainerState: one reader, one writer, old files read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from scaletrain.checkpoint.state import FILE, VERSION, TrainerState
from scaletrain.config import load_config
from scaletrain.data import PackedTokens
from scaletrain.errors import UserError
from scaletrain.models import model_spec
from scaletrain.training.rundir import check_resume

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "main_step2"


def test_a_trainer_json_of_main_before_versions_reads_as_version_1():
    state = TrainerState.read(FIXTURE / "step_2")
    assert (state.step, state.data_position, state.tokens_seen, state.world_size) == (2, 8, 128, 1)
    assert (state.format, state.engine, state.version, state.base) == ("dcp", "ddp", VERSION, None)
    assert (
        state.parallel["dp_size"] == 1 and state.model["dim"] == 16 and state.nonfinite == {"nonfinite_steps": 0, "rollbacks": 0}
    )
    written = json.loads(state.to_json())
    assert written["version"] == VERSION and "scheduler" not in written and "base" not in written
    assert TrainerState.from_dict(written) == state


def _with(tmp_path: Path, **changes: object) -> Path:
    ckpt = tmp_path / "step_2"
    shutil.copytree(FIXTURE / "step_2", ckpt)
    saved = json.loads((ckpt / FILE).read_text())
    saved.update(changes)
    (ckpt / FILE).write_text(json.dumps({k: v for k, v in saved.items() if v is not None}))
    return ckpt


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"version": VERSION + 1}, f"trainer state version {VERSION + 1}, written by a newer scaletrain"),
        ({"format": None}, "has no format stamp (written by an older scaletrain)"),
        ({"data_position": None}, "lacks data_position"),
    ],
)
def test_what_this_version_cannot_resume_is_one_line(tmp_path, changes, says):
    with pytest.raises(UserError, match="accepted:") as e:
        TrainerState.read(_with(tmp_path, **changes))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_an_unreadable_trainer_json_is_one_line(tmp_path):
    ckpt = _with(tmp_path)
    (ckpt / FILE).write_text("{not json")
    with pytest.raises(UserError, match=r"trainer.json is unreadable \(JSONDecodeError\); accepted:"):
        TrainerState.read(ckpt)


def test_a_resume_with_other_steps_says_the_learning_rate_before_and_after():
    # The fixture ran 4 steps (warmup 1, lr 3e-3, cosine to 3e-4); continued from step 2
    # with 8 steps, step 3's rate moves up the longer cosine: 3e-4 + 1.35e-3 x (1 + cos(pi / 7)).
    def notes(*overrides: str) -> list[str]:
        cfg = load_config([str(FIXTURE / "step_2" / "config.yaml")], [f"data.paths={FIXTURE / 'data'}", *overrides])
        tokens = PackedTokens(FIXTURE / "data", cfg.data.seq_len, cfg.train.seed)
        return check_resume(FIXTURE / "step_2", cfg, model_spec(cfg, tokens.vocab_size), tokens.fingerprint, 1)

    lines = [n for n in notes("train.steps=8") if "learning rate" in n]
    assert lines == [
        "resume: the learning rate of step 3 is 2.866e-03 (2.325e-03 under step_2's settings): "
        "the warmup + cosine schedule continues from here with the new settings"
    ]
    assert not [n for n in notes("train.log_every=2") if "learning rate" in n]  # not a setting of the schedule


def test_a_mixture_of_experts_checkpoint_resumed_without_its_experts_names_the_moe_key(tmp_path):
    # A MoE run's trainer.json holds the experts' shape beside the model's; resumed by a
    # config without model.moe, the line names the key as the config spells it.
    saved = json.loads((FIXTURE / "step_2" / FILE).read_text())
    ckpt = _with(tmp_path, model={**saved["model"], "experts": 4})
    cfg = load_config([str(FIXTURE / "step_2" / "config.yaml")], [f"data.paths={FIXTURE / 'data'}"])
    tokens = PackedTokens(FIXTURE / "data", cfg.data.seq_len, cfg.train.seed)
    with pytest.raises(UserError) as e:
        check_resume(ckpt, cfg, model_spec(cfg, tokens.vocab_size), tokens.fingerprint, 1)
    assert str(e.value).startswith("model.moe.experts is None but checkpoint ")
    assert "accepted: model.moe.experts=4 to resume it" in str(e.value)


class _Batches:
    position = 0


def test_the_runs_stateful_parts_restore_an_old_checkpoint_and_write_it_back_field_for_field(tmp_path):
    """training/state.py: each part owns its slice of TrainerState; together with the engine's
    stamp and extras they are the whole file, and an old checkpoint's slices load back into
    the parts and come out as they went in. Telemetry's running totals came later: the old
    file has none, so the device-hours stay what metrics.jsonl's last interval said."""
    from dataclasses import asdict, fields, replace

    import torch

    from scaletrain.launch.distributed import World
    from scaletrain.resilience.nonfinite import NonfiniteGuard
    from scaletrain.telemetry import MetricsLog
    from scaletrain.telemetry.session import Telemetry
    from scaletrain.training.state import Identity, Position, restore, state_of

    saved = TrainerState.read(FIXTURE / "step_2")
    identity = {k: getattr(saved, k) for k in ("world_size", "parallel", "model", "data_fingerprint", "base")}
    cfg = load_config([], [])
    metrics = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    metrics.write([{"step": 2, "event": "interval", "gpu_hours": 0.25}])
    telemetry = Telemetry(cfg, World(0, 1, 0, torch.device("cpu"), None), 1, ["h"], 1e6, tmp_path, metrics, 2)
    parts = {
        "position": Position(_Batches()),
        "identity": Identity(identity),
        "nonfinite": NonfiniteGuard(cfg.train, "fp32"),
        "telemetry": telemetry,
    }
    restore(parts, asdict(saved), parts)
    assert (parts["position"].step, parts["position"].tokens_seen, parts["position"].batches.position) == (2, 128, 8)
    engine_owned = {"format", "engine", "engine_state"}
    written = state_of(parts)
    # A MoE bias part, train.spikes' window (the guard on), `ckpt convert`'s note, the file's own.
    optional = {"expert_bias", "spikes", "converted_from", "version"}
    assert set(written) | engine_owned | optional == {f.name for f in fields(TrainerState)}
    assert written.pop("telemetry") == {"gpu_hours": 0.25}  # the old file had none: metrics.jsonl's figure
    assert TrainerState(**written, format=saved.format, engine=saved.engine, engine_state=saved.engine_state) == saved
    # A checkpoint that holds the totals wins over the metrics file (one copied without its run's rows, say).
    restore(parts, asdict(replace(saved, telemetry={"gpu_hours": 1.5})), ["telemetry"])
    assert state_of(parts)["telemetry"] == {"gpu_hours": 1.5}
    assert parts["position"].advance(64) == 3 and state_of(parts)["tokens_seen"] == 192  # the step's one writer
