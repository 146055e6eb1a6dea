"""Reading DeepSpeed ZeRO checkpoints offline, with DeepSpeed's own tools.

DeepSpeed's universal-checkpoint converter (`ds_to_universal`) merges every rank's flat
partitions into one folder per parameter ({fp32, exp_avg, exp_avg_sq}.pt); this module
only renames them to the neutral state's keys. The converter writes a few files per
parameter into a temporary directory that is removed afterwards. The model weights alone
come from `zero_to_fp32`, which reassembles the fp32 master partitions.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import torch

from scaletrain.checkpoint.layout import ParamLayout, State
from scaletrain.errors import UserError
from scaletrain.models.params import canonical_name

# DeepSpeed writes each checkpoint into <state>/<tag>/; one fixed tag, because our step
# directories already name the step. Beside it, as DeepSpeed does, a file `latest` holding
# the tag: DeepSpeed's own tools (zero_to_fp32.py, copied into state/) read the tag from it.
# Our readers name the tag themselves, so checkpoints written before `latest` existed still
# resume and export; which checkpoint is whole is decided by our COMPLETE marker alone.
DEEPSPEED_TAG = "zero"


class DeepSpeedFormat:
    name = "deepspeed"

    def read_state(self, state_dir: Path, layout: ParamLayout) -> State:
        with _universal(state_dir) as zero:
            return _read_universal(zero, layout)

    def read_weights(self, state_dir: Path) -> dict[str, torch.Tensor]:
        _cpu_accelerator_unless_cuda()
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # It reports progress with print() and tqdm: a library call should not.
        with open(os.devnull, "w") as sink, redirect_stdout(sink), redirect_stderr(sink):
            state = get_fp32_state_dict_from_zero_checkpoint(str(state_dir), tag=DEEPSPEED_TAG)
        return {canonical_name(name): t.float().contiguous() for name, t in state.items()}

    def open(self, state_dir: Path, layout: ParamLayout, stack: ExitStack) -> DeepSpeedTensors:
        return DeepSpeedTensors(stack.enter_context(_universal(state_dir)), layout)


class DeepSpeedTensors:
    """One tensor at a time from the universal form (checkpoint/neutral.py's WeightStream)."""

    def __init__(self, zero: Path, layout: ParamLayout):
        self._layout = layout
        self._folders = {canonical_name(p.name): p for p in zero.iterdir() if p.is_dir()}
        self.trained = {name for name, p in self._folders.items() if (p / "exp_avg.pt").is_file()}

    def holds(self, name: str) -> bool:
        return name in self._folders

    def get(self, name: str) -> torch.Tensor:
        return _universal_tensor(self._folders[name], "fp32", self._layout.shapes[name])


def _cpu_accelerator_unless_cuda() -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import


@contextmanager
def _universal(state_dir: Path) -> Iterator[Path]:
    """DeepSpeed's universal form of a ZeRO checkpoint, in a temporary directory: one folder
    per parameter under the yielded `zero/`."""
    _cpu_accelerator_unless_cuda()
    from deepspeed.checkpoint import ds_to_universal

    with tempfile.TemporaryDirectory(prefix="scaletrain-universal-") as tmp:
        out = Path(tmp) / "universal"
        args = argparse.Namespace(
            input_folder=str(state_dir / DEEPSPEED_TAG),
            output_folder=str(out),
            num_extract_workers=1,  # a process pool: more workers only help on many cores
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            # A plain nn.Module checkpoint lacks the Megatron-style metadata it asserts on.
            inject_missing_state=True,
        )
        # It reports progress with print() and tqdm: a library call should not.
        with open(os.devnull, "w") as sink, redirect_stdout(sink), redirect_stderr(sink):
            ds_to_universal.main(args)
        yield out / "zero"


def _universal_tensor(folder: Path, kind: str, shape: torch.Size) -> torch.Tensor:
    value = torch.load(folder / f"{kind}.pt", map_location="cpu", weights_only=False)
    value = value["param"] if isinstance(value, dict) else value  # ZeRO-1/2: {"param", "cat_dim"}; ZeRO-3: flat 1-D
    return value.detach().float().reshape(shape).contiguous()


def _read_universal(zero: Path, layout: ParamLayout) -> State:
    common = torch.load(zero / "optimizer_state.pt", map_location="cpu", weights_only=False)
    # ZeRO-1/2 write step.pt per parameter; ZeRO-3 keeps one step per group in its optimizer state.
    inner = common.get("optimizer_state_dict", {}).get("state", {})
    group_step = max((int(s["step"]) for s in inner.values() if "step" in s), default=0)
    state: State = {"model": {}, "optim": {}}
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        name = canonical_name(folder.name)
        if name not in layout.shapes:
            raise UserError(
                f"DeepSpeed checkpoint holds {name!r}, which this model does not have; accepted: a checkpoint of this model"
            )
        shape = layout.shapes[name]
        state["model"][name] = _universal_tensor(folder, "fp32", shape)
        if (folder / "exp_avg.pt").is_file():
            for kind in ("exp_avg", "exp_avg_sq"):
                state["optim"][f"state.{name}.{kind}"] = _universal_tensor(folder, kind, shape)
            step = torch.load(folder / "step.pt", weights_only=False) if (folder / "step.pt").is_file() else group_step
            state["optim"][f"state.{name}.step"] = torch.tensor(float(step))
    return state
