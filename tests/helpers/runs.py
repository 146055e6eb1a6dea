"""The runs the tests train (the overrides they share, a run killed and resumed link by
link, a run directory cut at a checkpoint) and readers of what a run wrote: its metric and
eval rows, run.json, its checkpoints' weights and the model they hold."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scaletrain.checkpoint import TrainerState, read_model_weights
from scaletrain.models import saved_spec
from scaletrain.telemetry import read_metrics

from helpers.launch import check, train

STDLIB = Path(sysconfig.get_paths()["stdlib"])


# A small, fixed corpus every Python has: enough tokens for short runs, quick to tokenize.
SMALL_CORPUS = [str(STDLIB / "json" / "*.py"), str(STDLIB / "email" / "*.py"), str(STDLIB / "collections" / "*.py")]


def trainer_state(**fields: Any) -> TrainerState:
    """A checkpoint's TrainerState for tests that write or check one by hand: a DDP run at
    world 1 with these fields changed."""
    parallel = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "dp_size": 1}
    base = dict(step=1, data_position=0, tokens_seen=0, world_size=1, parallel=parallel, format="dcp", engine="ddp")
    return TrainerState(**{**base, "model": {}, "data_fingerprint": "x", **fields})


def base_overrides(data_dir: Path, run_dir: Path, steps: int = 10) -> list[str]:
    return [
        "model.preset=tiny",
        f"data.paths={data_dir}",
        "data.seq_len=64",
        f"train.steps={steps}",
        "train.warmup_steps=2",
        "train.lr=3e-3",
        "train.log_every=5",
        "run.device=cpu",
        f"run.dir={run_dir}",
    ]


# Evaluation during the equivalence runs (training/evaluation.py): every 4 steps and after the last
# (steps 4, 8, 10 of 10), 2 global batches of the reference's 4 sequences. On the training
# corpus itself, read in its file order: a fixed set of windows is all an equivalence
# needs, and eval.data (unlike eval.split) leaves the training stream as it was, so every
# resume of the shared runs goes on meaning what it meant.
EVAL_BATCHES = 2


def eval_overrides(data_dir: Path, every: int = 4) -> list[str]:
    return [f"eval.every={every}", f"eval.data={data_dir}", f"eval.batches={EVAL_BATCHES}"]


# The context-parallel runs (test_context_parallel.py, test_ulysses.py): 8 steps of 4 x 256
# tokens, checkpointed, logged and evaluated every 4; the straight run is conftest's `cp_straight`.
CP_STEPS, CP_EVERY, CP_SEQ = 8, 4, 256


def cp_overrides(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        *base_overrides(data_dir, run_dir, steps=CP_STEPS),
        f"data.seq_len={CP_SEQ}",
        f"checkpoint.every={CP_EVERY}",
        f"train.log_every={CP_EVERY}",
        *eval_overrides(data_dir, every=CP_EVERY),
        *extra,
    ]


def eval_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl", events=True) if r.get("event") == "eval"]


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "one row per optimizer step, in order"
    return rows


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in metric_rows(run_dir)]


def step_figures(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, loss, grad norm) of every step row as written, a resumed run's rows included."""
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run_dir / "metrics.jsonl")]


def grad_norms(run_dir: Path) -> list[float]:
    return [r["grad_norm"] for r in metric_rows(run_dir)]


def run_info(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "run.json").read_text())


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return read_model_weights(run_dir / "checkpoints" / f"step_{step}")


def checkpoint_model(ckpt: Path, seq_len: int) -> torch.nn.Module:
    """The model a checkpoint holds (the spec its trainer.json names, its weights), in eval mode."""
    saved = json.loads((ckpt / "trainer.json").read_text())
    spec = saved_spec(saved["model"])
    model = spec.build_meta(seq_len)
    spec.materialize(model, torch.device("cpu"), seed=0)  # buffers (rotary tables) and ties as in training
    missing, unexpected = model.load_state_dict(read_model_weights(ckpt), strict=False)
    assert not unexpected and set(missing) <= {"output.weight", "lm_head.weight"}  # a tied head is the embedding
    return model.eval()


def loss_of(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """The mean next-token cross entropy of `model` over `windows` (n, seq_len + 1): what
    an evaluation of those windows computes, here in one forward, without the engines."""
    with torch.no_grad():
        out = model.eval()(windows[:, :-1])
    logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), windows[:, 1:].reshape(-1)).item()


def dataset_windows(data_dir: Path, count: int, seq_len: int) -> torch.Tensor:
    """The first `count` windows of a prepared dataset's tokens in file order, read from its
    shard files: what eval.data=<that directory> evaluates on."""
    m = json.loads((data_dir / "manifest.json").read_text())
    stream = np.concatenate([np.fromfile(data_dir / s["file"], dtype=m["dtype"]).astype(np.int64) for s in m["shards"]])
    return torch.from_numpy(np.stack([stream[k * seq_len : k * seq_len + seq_len + 1] for k in range(count)]))


def train_through(run: Path, links: list[tuple[list[str], int, str]], every: int, timeout: int = 240) -> None:
    """Train `run` link by link, `every` steps each: a link is (overrides, world size, how
    the resume names its layout, e.g. "fsdp at world 3"). Every link but the last is
    killed right after its checkpoint (what a preempted job leaves) and the next resumes it
    on its own layout, verified; the last runs to the end."""
    for i, (args, world, _) in enumerate(links):
        stop = every * (i + 1)
        last = i == len(links) - 1
        proc = train(args, nproc=world, env={} if last else {"SCALETRAIN_KILL_AT": f"step:{stop}"}, timeout=timeout)
        if last:
            check(proc)
        else:
            assert proc.returncode != 0 and (run / "checkpoints" / f"step_{stop}" / "COMPLETE").is_file(), proc.stderr[-2000:]
        if i > 0:
            said = f"step_{stop - every} ({links[i - 1][2]})"
            assert said in proc.stdout and "; verified" in proc.stdout, proc.stdout[-2000:]
        assert [r["step"] for r in metric_rows(run)] == list(range(1, stop + 1))


def copy_until(run: Path, to: Path, step: int) -> None:
    """A run directory as `run` was after its checkpoint at `step`: what a kill right after it leaves."""
    (to / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / f"step_{step}", to / "checkpoints" / f"step_{step}")
    # The step rows and the evaluations up to it (a resumed run keeps those, training/evaluation.py).
    rows = [r for r in read_metrics(run / "metrics.jsonl", events=True) if r["step"] <= step and r.get("event", "eval") == "eval"]
    (to / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


# The tiny model's tensors are all below DeepSpeed's default persistence threshold (1e5
# elements), so ZeRO-3 would keep every one of them whole on every rank; 0 makes it really
# partition them. It is also a non-conflicting deepspeed_extra key, merged in.
Z3_PARTITION_ALL = "parallel.deepspeed_extra={zero_optimization: {stage3_param_persistence_threshold: 0}}"


# A loss scale that overflows on this model (2**20) and a window of 2: within 10 steps the
# scale halves (skipped steps) and grows again, before and after the checkpoint at step 5,
# so the resumed run is only identical if the scaler's whole state came back.
FP16_MOVING_SCALE = ["precision=fp16", "train.loss_scale_init=1048576", "train.loss_scale_window=2"]


def checkpoint_state(run_dir: Path, step: int, seq_len: int = 64) -> dict[str, Any]:
    """The neutral state (weights and optimizer) of a tiny-shaped run's checkpoint at `step`."""
    from scaletrain.checkpoint.neutral import ParamLayout, read_state
    from scaletrain.models import LlamaSpec
    from scaletrain.models.presets import ModelShape

    ckpt = run_dir / "checkpoints" / f"step_{step}"
    shape = ModelShape(**json.loads((ckpt / "trainer.json").read_text())["model"])
    return read_state(ckpt, ParamLayout(LlamaSpec(shape).build_meta(seq_len)))
