"""How tests start processes, and how they read what a run wrote.

One launcher for everything: the CLI as users run it (`scaletrain train`, `scaletrain
launch --nproc N`) and the probe programs under tests/probes (torchrun --standalone, so
torchrun picks its own free port). Each process starts in a session of its own with its
output going to files (no pipe can fill up and block it), carries a tag in its
environment, and in a `finally` every process with that tag is SIGKILLed: torchrun's
workers start sessions of their own and are re-parented when the agent dies, so neither
the process group nor the parent link finds them all, the tag does. No subprocess
outlives its test: its timeout is capped by what is left of the test's pytest-timeout
(set per test in conftest.py), so the launcher kills and reports first.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from scaletrain.checkpoint import TrainerState, read_model_weights
from scaletrain.models import saved_spec
from scaletrain.telemetry import read_metrics

from forkserver import Client, Forked

TESTS = Path(__file__).resolve().parent
PROBES = TESTS / "probes"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# A small, fixed corpus every Python has: enough tokens for short runs, quick to tokenize.
SMALL_CORPUS = [str(STDLIB / "json" / "*.py"), str(STDLIB / "email" / "*.py"), str(STDLIB / "collections" / "*.py")]

_TAG = "SCALETRAIN_TEST_TAG"
_MARGIN_S = 10.0  # what a test keeps for itself after its last subprocess was killed
_deadline = float("inf")
_forks = Client()  # this pytest process's fork server (tests/forkserver.py)


def set_deadline(seconds_from_now: float) -> None:
    global _deadline
    _deadline = time.monotonic() + seconds_from_now


# ---------------------------------------------------------------------------- processes


class Launched:
    """A started process tree whose output goes to files."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None, one_thread: bool = True, new_process: bool = False):
        self.cmd = cmd
        self.tag = uuid.uuid4().hex
        self._dir = tempfile.TemporaryDirectory(prefix="scaletrain-test-")
        # Open for the life of the process (closed in __del__): files, not pipes, so a chatty
        # process never blocks on a full pipe nobody reads.
        self._out = open(Path(self._dir.name) / "stdout", "w+")  # noqa: SIM115
        self._err = open(Path(self._dir.name) / "stderr", "w+")  # noqa: SIM115
        full_env = {**os.environ, **({"OMP_NUM_THREADS": "1"} if one_thread else {}), **(env or {}), _TAG: self.tag}
        # A Python command forks from the server that has its imports done, unless the test
        # asks for a new process or the fork could differ from one (forkserver.py).
        forked = None if new_process else _forks.start(cmd, full_env, self._out, self._err)
        self.proc: subprocess.Popen | Forked = forked or subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._out, stderr=self._err, text=True, env=full_env, start_new_session=True
        )

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        limit = min(timeout, _deadline - time.monotonic() - _MARGIN_S)
        try:
            self.proc.wait(timeout=max(limit, 1.0))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"timed out after {limit:.0f} s: {' '.join(self.cmd)}\n{self._read(self._err)[-3000:]}"
            ) from None
        finally:
            self.kill()
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, self._read(self._out), self._read(self._err))

    def kill(self) -> None:
        for pid in {*_tagged(self.tag), *_in_session(self.proc.pid)}:
            with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @staticmethod
    def _read(f: Any) -> str:
        f.flush()
        f.seek(0)
        return f.read()

    def __del__(self) -> None:
        self.kill()
        self._out.close()
        self._err.close()
        self._dir.cleanup()


def _tagged(tag: str) -> list[int]:
    needle = f"{_TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if needle in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
            except OSError:  # gone meanwhile, or not ours
                pass
    return found


def _in_session(sid: int) -> list[int]:
    """The processes in session `sid` (the one each Launched process starts): a forked
    command's descendants, whose /proc/PID/environ is the fork server's, without the tag."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            # pid (comm) state ppid pgrp session ...: comm may hold spaces, so after its ')'.
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                found.append(int(entry))
    return found


def run(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300, one_thread: bool = True, new_process: bool = False
) -> subprocess.CompletedProcess:
    """Run to completion (or to the timeout, then kill the whole tree and fail)."""
    return Launched(cmd, env, one_thread, new_process).wait(timeout)


def scaletrain(args: list[str], **kw: Any) -> subprocess.CompletedProcess:
    """`scaletrain ARGS` in one process, as a user types it."""
    return run([sys.executable, "-m", "scaletrain", *args], **kw)


def train(args: list[str], nproc: int = 1, **kw: Any) -> subprocess.CompletedProcess:
    """`scaletrain train ARGS`, or `scaletrain launch --nproc N ARGS` for N ranks."""
    if nproc == 1:
        return scaletrain(["train", *args], **kw)
    return scaletrain(["launch", "--nproc", str(nproc), *args], **kw)


def torchrun(args: list[str], nproc: int) -> list[str]:
    """torchrun with a private rendezvous on a port it picks itself."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def probe_command(name: str, args: list[str], nproc: int = 1) -> list[str]:
    script = str(PROBES / f"{name}.py")
    return [sys.executable, script, *args] if nproc == 1 else torchrun([script, *args], nproc)


def probe(name: str, args: list[str], out: Path, nproc: int = 1, **kw: Any) -> list[dict[str, Any]]:
    """Run tests/probes/NAME.py on `nproc` ranks; each rank writes `out/rank<R>.json`, returned by rank."""
    out.mkdir(parents=True, exist_ok=True)
    check(run(probe_command(name, ["--out", str(out), *args], nproc), **kw))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2, no traceback, exactly one stderr line, holding every fragment."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaletrain: error:"), proc.stderr[-3000:]
    missing = [f for f in fragments if f not in lines[0]]
    assert not missing, f"{missing} not in {lines[0]!r}"
    return lines[0]


# ---------------------------------------------------------------------------- run directories


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


# ---------------------------------------------------------------------------- equivalence
#
# What a correct engine guarantees against one process on the same global batch, in fp32.
# Measured over every equivalence test (world 2 and 3, accumulation, all engines), under
# ATEN_CPU_CAPABILITY=avx2 and =default; a factor in the gradient (a loss divided twice
# by grad_accum, a sum over ranks instead of a mean) moves the grad norm by >= 2x, which
# AdamW and clipping would hide from the losses.
#
# * Step 1 starts from identical weights: loss and grad norm differ only by summation
#   order (per rank, micro-batch, shard; fp32 unit roundoff 6e-8 per addition).
#   Measured <= 2.8e-7; rtol 1e-5.
# * Later steps start from weights that have drifted apart: Adam divides by sqrt(v), so an
#   element whose gradient is within rounding noise of zero takes a step of up to ~lr
#   whatever the noise (m/sqrt(v) is O(1) for any tiny g), and two correct engines may end
#   that element up to lr x steps apart (seen: 1.5e-5 in one element of 49,152 after 10
#   steps, on one CPU and not another). The loss, a mean over 4 x 64 tokens, hardly feels
#   it: measured <= 4.9e-7, rtol 1e-5 at every step. The grad norm does at some steps (the
#   norm of a few dominant entries): measured <= 5.7e-4 (world 3), rtol 5e-3, still 200x
#   below a factor-of-two bug.
# * The eval loss at step N is the same kind of number as the training loss of step N + 1:
#   a mean next-token cross entropy over a fixed set of tokens (2 x 4 x 64 here), computed
#   from the weights after step N, which two correct engines hold up to the drift above.
#   What the evaluation adds is summation order only: each micro-batch's mean back to its
#   sum in fp64, summed over micro-batches and ranks (exact to ~1e-16). So the loss
#   tolerance holds for it too: measured <= 9.6e-8 (zero1-3, fsdp, tp 2, tp 2 x dp 2,
#   pp 2 x dp 2, a teacher on zero3, experts on ep 2). A rank's own mean reported as the
#   whole set's (no reduction over the ranks) was off by 1.3e-3 at world 2, 127x the
#   tolerance; sums reduced without the token counts would be off by a factor of 2.
# * Weights, per tensor, as a relative (Frobenius) difference, not elementwise: the rare
#   amplified elements leave a tensor <= 2.8e-5 apart (measured, world 3); a tensor the
#   optimizer skipped is off by ~0.5, one decayed wrongly by >= 2e-3 (lr 3e-3 x decay 0.1
#   x 10 steps, relative to the weight). Allowed: 2e-4.
# Gradients after one backward are compared elementwise, in tests/test_gradients.py.

RTOL_FIRST_STEP = 1e-5
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 5e-3
WEIGHTS_RTOL = 2e-4


def assert_same_training(
    run: Path,
    ref: Path,
    steps: int = 10,
    evals: bool = True,
    weights_rtol: float = WEIGHTS_RTOL,
    gradient_free: dict[str, slice] | None = None,
    loss_rtol: float = LOSS_RTOL,
) -> None:
    if evals:
        assert_same_evals(run, ref, loss_rtol)
    a, b = metric_rows(ref), metric_rows(run)
    assert len(a) == len(b) == steps
    losses_a, losses_b = [r["loss"] for r in a], [r["loss"] for r in b]
    norms_a, norms_b = [r["grad_norm"] for r in a], [r["grad_norm"] for r in b]
    np.testing.assert_allclose(norms_b[0], norms_a[0], rtol=RTOL_FIRST_STEP, err_msg="grad norm of step 1")
    np.testing.assert_allclose(losses_b, losses_a, rtol=loss_rtol, err_msg="loss per step")
    np.testing.assert_allclose(norms_b, norms_a, rtol=GRAD_NORM_RTOL, err_msg="grad norm per step")
    assert losses_a[-1] < losses_a[0]  # it trained, not just agreed
    assert_weights_close(final_weights(run, steps), final_weights(ref, steps), weights_rtol, gradient_free, steps)


def assert_same_evals(run: Path, ref: Path, loss_rtol: float = LOSS_RTOL) -> None:
    want, got = eval_rows(ref), eval_rows(run)
    assert want, f"{ref} has no eval rows to compare with"
    assert [(r["step"], r["tokens"]) for r in got] == [(r["step"], r["tokens"]) for r in want]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=loss_rtol, err_msg="eval loss")


# Elements whose gradient is zero by construction (e.g. an attention key's bias: it adds
# q.b to every score of a query, which the softmax ignores) receive rounding noise only, and
# Adam steps on noise as on anything (the first bullet above): each engine moves them up to
# its per-step bound, lr x max(1, (1 - beta1) / sqrt(1 - beta2)) (Kingma & Ba, section 2.1;
# 1 at the defaults 0.9 / 0.95), from where they started. Seen: an attention key bias 1.3e-5
# in norm, half of it apart between two engines on an avx512 CPU, which no relative
# tolerance of the tensor's other elements survives. No bug can show in them (nothing but
# noise reaches them), so they are held to that bound, the rest of the tensor to rtol.
GRADIENT_FREE_STEP = 3e-3  # base_overrides' peak train.lr, at the default betas


def assert_weights_close(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    rtol: float = WEIGHTS_RTOL,
    gradient_free: dict[str, slice] | None = None,
    steps: int = 0,
) -> None:
    # Key equality: wrappers (activation checkpointing, FSDP, DeepSpeed) leave names plain.
    assert got.keys() == want.keys()
    for k in got:
        assert got[k].shape == want[k].shape, k
        a, b = got[k].double().flatten(), want[k].double().flatten()
        if gradient_free and k in gradient_free:
            free = torch.zeros(a.numel(), dtype=torch.bool)
            free[gradient_free[k]] = True
            apart = (a[free] - b[free]).abs().max().item()
            assert apart <= 2 * steps * GRADIENT_FREE_STEP, f"{k}: gradient-free elements {apart:.2e} apart"
            a, b = a[~free], b[~free]
        rel = ((a - b).norm() / b.norm()).item()
        assert rel <= rtol, f"{k}: relative difference {rel:.2e} (up to {rtol:.0e} allowed)"


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


def assert_bit_exact(run: Path, straight: Path, step: int) -> None:
    """A resumed run equals the uninterrupted one: every metric of every step, every
    evaluation (none lost, none twice), every weight."""
    keys = ("step", "loss", "grad_norm", "lr", "tokens", "loss_scale", "skipped", "perplexity")
    pick = lambda rows: [{k: r[k] for k in keys if k in r} for r in rows]  # noqa: E731
    # As JSON text: a skipped fp16 step's grad norm may be NaN, which equals nothing as a float.
    got, want = (list(map(json.dumps, pick(metric_rows(r) + eval_rows(r)))) for r in (run, straight))
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want):
        assert g == w, f"first difference:\n  resumed  {g}\n  straight {w}"
    a, b = final_weights(run, step), final_weights(straight, step)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# The tiny model's tensors are all below DeepSpeed's default persistence threshold (1e5
# elements), so ZeRO-3 would keep every one of them whole on every rank; 0 makes it really
# partition them. It is also a non-conflicting deepspeed_extra key, merged in.
Z3_PARTITION_ALL = "parallel.deepspeed_extra={zero_optimization: {stage3_param_persistence_threshold: 0}}"


# A loss scale that overflows on this model (2**20) and a window of 2: within 10 steps the
# scale halves (skipped steps) and grows again, before and after the checkpoint at step 5,
# so the resumed run is only identical if the scaler's whole state came back.
FP16_MOVING_SCALE = ["precision=fp16", "train.loss_scale_init=1048576", "train.loss_scale_window=2"]


def assert_scale_moved(run) -> None:
    rows = metric_rows(run)
    scales = [r["loss_scale"] for r in rows]
    assert any(r["skipped"] for r in rows[:5]), scales  # backed off before the checkpoint at step 5
    assert len(set(scales[4:])) > 1, scales  # and moved again after it
    assert np.mean([r["loss"] for r in rows[-3:]]) < rows[0]["loss"] - 0.3  # and it trained


# ---------------------------------------------------------------------------- exports


def assert_hf_export_matches(ckpt: Path, out: Path, tokens: int = 48) -> None:
    """transformers loads the export `out` of checkpoint `ckpt` and gives the logits of the
    built-in model holding the checkpoint's weights. fp32 both sides, same weights: the two
    implementations differ only in summation order (attention through SDPA or not, RMSNorm's
    mean), a few ulps of logits of size ~10 after 4 layers; atol 1e-5 is ~100 ulps."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from scaletrain.models.llama import Llama
    from scaletrain.models.presets import ModelShape

    saved = json.loads((ckpt / "trainer.json").read_text())
    ours = Llama(ModelShape(**saved["model"]), max_seq_len=tokens)
    ours.load_state_dict(read_model_weights(ckpt))
    theirs = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    text = (STDLIB / "json" / "decoder.py").read_text()
    ids = torch.tensor([tokenizer.encode(text)[:tokens]])
    assert ids.shape[1] == tokens
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------- the browser

# Debian's chromium, as root, with nothing that reaches for the network (the machine has
# none: background services would fail their lookups at every start).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,2400",
    "--virtual-time-budget=5000",
]


def render_in_chromium(page: Path, tmp: Path) -> str:
    """Render `page` in headless Chromium: asserts a full-size screenshot was produced and
    returns the rendered DOM."""
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed: `make test` installs it (apt-get install chromium) on a fresh machine"
    png = tmp / "page.png"
    args = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'chromium-profile'}", f"--screenshot={png}", "--dump-dom"]
    # run(): a timeout, and chromium's zygote and renderers are killed with it
    proc = run([*args, page.resolve().as_uri()], timeout=90, one_thread=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000, len(data)
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (1280, 2400)
    return proc.stdout
