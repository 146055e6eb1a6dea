"""The README's examples as written (issue 60): every command of its "Two commands" and "Use"
blocks and its Python block, docs/api.md's code blocks and docs/models.md's own-model example,
each read from the document when the test runs and run in a scratch directory, each exiting 0.
A document edit that breaks an example fails here (plant: a wrong key in a README line).

What the examples name, the test makes: `my.yaml` (a tiny model, short sequences, run.dir
runs/my, evaluated every 100 steps so that `scaletrain.evaluate` has held-out documents), a
small corpus for `data prepare`, ARC's file for the downstream task, the runs `compare`
names (4 steps of my.yaml on each engine). A `scaletrain ...` line runs as `python -m scaletrain ...` (the console script is
that module's main) and `torchrun` as `python -m torch.distributed.run`, forked from the
suite's server (tests/forkserver.py). Stand-ins where running as written cannot be the test:
- `make demo`: its recipe's command (the Makefile's, read here), in the scratch directory;
  `make test` (this suite itself): .ci/run calls it, and its recipe runs both parts unfiltered.
- `scaletrain watch` serves until Ctrl-C: the page is fetched, then SIGINT, then exit 0.
- `scaletrain bench` (minutes of timed runs; tests/test_bench.py runs its loops): with
  `--dry-run`, which resolves every run's command and config and runs nothing.
The README's lines share one directory in order (after the demo's run: `eval`, `diagnose`,
`verify` and `watch` read runs/demo); each docs block gets a fresh one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from scaletrain import checkpoint
from scaletrain.telemetry.metrics import read_metrics

from helpers.launch import TESTS, Launched, check, run
from helpers.runs import losses, run_info

pytestmark = pytest.mark.e2e

ROOT = TESTS.parent
README = ROOT / "README.md"

# What `my.yaml` says wherever an example names it: the built-in tiny model on the embedded
# default's data, a short sequence, its own run directory, evaluated every 100 steps (1% of
# the documents held out: eval.split's default when eval.every is set).
MY_YAML = """\
model: {preset: tiny}
data: {seq_len: 32}
train: {micro_batch: 2, steps: 20, log_every: 10}
eval: {every: 100}
run: {dir: runs/my}
"""
# A model of one's own names no built-in shape: my.yaml without the model section.
OWN_YAML = MY_YAML.replace("model: {preset: tiny}\n", "")
# The downstream task `scaletrain eval ... eval.tasks=[{... path: arc_easy.jsonl ...}]` reads.
ARC = [
    {"question": "What color is the sky on a clear day?", "choices": {"text": ["blue", "green"], "label": ["A", "B"]}, "answerKey": "A"},
    {"question": "Which is a liquid?", "choices": {"text": ["stone", "water"], "label": ["A", "B"]}, "answerKey": "B"},
]  # fmt: skip


def fenced(path: Path, lang: str, section: str | None = None) -> list[str]:
    """The `lang` code blocks of `path`, or of its section headed `section` (to the next
    heading of the same or a higher level)."""
    text = path.read_text()
    if section is not None:
        level = len(section.split(" ", 1)[0])
        assert f"\n{section}\n" in text, f"{path.name} has no section {section!r}"
        kept, fenced_now = [], False
        for line in text.split(f"\n{section}\n", 1)[1].splitlines():
            fenced_now ^= line.startswith("```")
            heading = re.match(r"(#+) ", line)
            if heading and not fenced_now and len(heading.group(1)) <= level:
                break
            kept.append(line)
        text = "\n".join(kept) + "\n"
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def lines(block: str) -> list[str]:
    """A shell block's commands: every line but blank ones and whole-line comments."""
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def argv_of(line: str) -> list[str]:
    """The Python command that runs the shell line `line` as written."""
    head, *rest = shlex.split(line, comments=True)
    if head in ("scaletrain", ".venv/bin/scaletrain"):
        return [sys.executable, "-m", "scaletrain", *rest]
    if head == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *rest]
    if head == ".venv/bin/python":
        return [sys.executable, *rest]
    raise AssertionError(f"an example runs {head!r}, which this test does not know how to run: {line}")


def scratch(where: Path, my_yaml: str = MY_YAML) -> Path:
    """A directory with what the examples name: my.yaml, .venv and scripts/ as in the repository."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "my.yaml").write_text(my_yaml)
    for name in (".venv", "scripts", "examples"):
        if (ROOT / name).exists() and not (where / name).exists():
            (where / name).symlink_to(ROOT / name)
    return where


def run_line(line: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    argv = argv_of(line)
    if argv[3:4] == ["bench"]:
        argv.append("--dry-run")  # minutes of timed runs (tests/test_bench.py runs its loops)
    previous = os.getcwd()
    os.chdir(cwd)  # the launcher starts each command in the test's working directory
    try:
        if argv[3:4] == ["watch"]:
            return _watch(argv)
        return run(argv, env=env, timeout=timeout)
    finally:
        os.chdir(previous)


def _watch(argv: list[str]) -> subprocess.CompletedProcess:
    """`scaletrain watch RUN` as a user runs it: the page answers, then Ctrl-C ends it with 0."""
    served = Launched(argv)
    port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 8765
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as page:
                assert page.status == 200 and b"<html" in page.read(200).lower()
            break
        except OSError:
            assert served.proc.poll() is None, served.wait(1).stderr[-2000:]
            assert time.monotonic() < deadline, "the watch page never answered"
            time.sleep(0.5)
    os.kill(served.proc.pid, signal.SIGINT)
    return served.wait(30)


def recipe(target: str) -> list[str]:
    """The commands of a Makefile target's recipe, $(BIN) as .venv/bin."""
    text = (ROOT / "Makefile").read_text()
    body = text.split(f"\n{target}:", 1)[1].split("\n", 1)[1]
    out = []
    for line in body.splitlines():
        if not line.startswith("\t"):
            break
        out.append(line.strip().replace("$(BIN)", ".venv/bin"))
    return out


def corpus(where: Path) -> None:
    """What `data prepare --input 'corpus/**/*.txt' 'more/*.jsonl'` reads: stdlib sources as text, a JSONL file."""
    (where / "corpus" / "json").mkdir(parents=True, exist_ok=True)
    (where / "more").mkdir(exist_ok=True)
    for source in Path(json.__file__).parent.glob("*.py"):
        (where / "corpus" / "json" / f"{source.stem}.txt").write_text(source.read_text())
    docs = [{"text": f"Document {i}. " + Path(shlex.__file__).read_text()[i * 400 : (i + 1) * 400]} for i in range(40)]
    (where / "more" / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))


@pytest.fixture(scope="module")
def readme_dir(tmp_path_factory) -> Path:
    where = scratch(tmp_path_factory.mktemp("readme"))
    corpus(where)
    (where / "arc_easy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ARC))
    return where


@pytest.mark.timeout(900)
def test_the_two_commands(readme_dir):
    (block,) = fenced(README, "bash", "## Two commands")
    assert [shlex.split(line, comments=True) for line in lines(block)] == [["make", "demo"], ["make", "test"]], block
    # `make test` is this suite (`make -n` would run it: its recipe calls $(MAKE)): CI runs
    # exactly it, and it runs every test, both parts, without a filter.
    assert "make test" in (ROOT / ".ci" / "run").read_text().splitlines()
    parts = [c for c in recipe("test") if "pytest" in c]
    assert len(parts) == 2 and all(" -k " not in c for c in parts), parts
    assert '-m "not serial"' in parts[0] and parts[1].endswith("-m serial"), parts
    # `make demo`: set-up (done: this suite runs in it), then its training command, as written.
    (command,) = [c for c in recipe("demo") if "scaletrain train" in c]
    proc = check(run_line(command, readme_dir, timeout=840))
    # The demo learns (README: about 4 nats over its 300 steps; at least 1 nat, as the
    # acceptance of `make demo` says) and holds its eval documents out for `scaletrain eval`.
    trajectory = losses(readme_dir / "runs" / "demo")
    assert len(trajectory) == 300 and trajectory[-1] <= trajectory[0] - 1.0, (trajectory[0], trajectory[-1])
    assert "training finished" in proc.stdout and "Warning" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    print(f"make demo: loss {trajectory[0]:.2f} -> {trajectory[-1]:.2f}\n{proc.stdout[-1500:]}")
    assert [s for s, _ in checkpoint.complete_checkpoints(readme_dir / "runs" / "demo" / "checkpoints")] == [100, 200, 300]
    assert run_info(readme_dir / "runs" / "demo")["engine"] == "ddp"
    # The README's `scaletrain eval runs/demo`: the checkpoint's eval loss is the run's last
    # eval row, on the documents the demo held out (issue 60: it said "nothing to evaluate on").
    row = [r for r in read_metrics(readme_dir / "runs" / "demo" / "metrics.jsonl", events=True) if r.get("event") == "eval"][-1]
    said = check(run_line("scaletrain eval runs/demo", readme_dir)).stdout
    assert f"(step 300): loss {row['loss']:.6f}" in said and "eval.split=0.01" in said, said


def _use_lines() -> list[str]:
    """The shell lines of the "Use" section's blocks (the commands, then the checkpoint tools)."""
    return [line for block in fenced(README, "bash", "## Use") for line in lines(block)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("line", _use_lines(), ids=lambda line: " ".join(shlex.split(line, comments=True)[:3]))
def test_each_use_line_exits_0(readme_dir, line):
    if " compare " in f" {line} ":
        # The runs it compares, each trained on the engine its name says (4 steps of my.yaml).
        for name in shlex.split(line, comments=True)[2:]:
            if not (readme_dir / name).exists():
                made = f"scaletrain train my.yaml parallel.strategy={Path(name).name} run.dir={name} train.steps=4"
                check(run_line(made, readme_dir))
    proc = run_line(line, readme_dir)
    assert proc.returncode == 0, f"{line}\nexit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


@pytest.mark.timeout(300)
def test_the_python_block(readme_dir):
    (block,) = fenced(README, "python", "## Use")
    (readme_dir / "readme_example.py").write_text(block)
    check(run_in(readme_dir, ["readme_example.py"]))


def run_in(cwd: Path, args: list[str], pythonpath: list[Path] = ()) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)} if pythonpath else None
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        return run([sys.executable, *args], env=env, timeout=280)
    finally:
        os.chdir(previous)


def files_of(block: str) -> dict[str, str]:
    """A block that shows several files, each begun by a `# path` comment line, by path."""
    files: dict[str, list[str]] = {}
    current = None
    for line in block.splitlines():
        named = re.match(r"#\s+(\S+\.py)\b", line)
        if named:
            current = named.group(1)
            files[current] = []
        elif current is not None:
            files[current].append(line)
    return {path: "\n".join(body) + "\n" for path, body in files.items()}


@pytest.mark.timeout(300)
def test_the_api_doc_blocks(tmp_path):
    first, own = fenced(ROOT / "docs" / "api.md", "python")
    where = scratch(tmp_path / "api")
    (where / "api_example.py").write_text(first)
    check(run_in(where, ["api_example.py"]))
    # The model of one's own: my_models/gpt.py and train.py as the block shows them; GPT is
    # examples/gpt2's, which the block's module imports from PYTHONPATH.
    where = scratch(tmp_path / "api-own", OWN_YAML)
    for path, text in files_of(own).items():
        (where / path).parent.mkdir(parents=True, exist_ok=True)
        (where / path).write_text(text)
    check(run_in(where, ["train.py"], pythonpath=[where, ROOT / "examples" / "gpt2"]))
    trainer = json.loads(next((where / "runs" / "my" / "checkpoints").glob("step_*/trainer.json")).read_text())
    assert "my_models.gpt:make_spec" in json.dumps(trainer), trainer


@pytest.mark.timeout(300)
def test_the_own_model_example_in_models_doc(tmp_path):
    section = "## A model of your own (`model.source: python`)"
    module = fenced(ROOT / "docs" / "models.md", "python", section)[0]
    config = fenced(ROOT / "docs" / "models.md", "yaml", section)[0]
    where = scratch(tmp_path / "models")
    (where / "my_models").mkdir()
    (where / "my_models" / "gpt.py").write_text(module)
    (where / "own.yaml").write_text(config)
    line = "scaletrain train own.yaml data.seq_len=32 train.micro_batch=2 train.steps=4 run.dir=runs/own"
    proc = run_line(line, where, env={"PYTHONPATH": os.pathsep.join([str(where), str(ROOT / "examples" / "gpt2")])})
    check(proc)
    trainer = json.loads(next((where / "runs" / "own" / "checkpoints").glob("step_*/trainer.json")).read_text())
    assert "my_models.gpt:make_spec" in json.dumps(trainer), trainer
