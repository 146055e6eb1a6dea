"""The bench's own runs of `python -m scaletrain ...` (bench/forked_runs.py): forked from a
server that has done their imports, each what a new process would be: its exit code, its
output in its log, the environment as it is when it starts; a new process wherever a fork
could differ.

The checks run in a Python of their own (a script, as the bench's CLI is): the standard
library's forkserver is one per process, and a test of this pytest process may have started it
with another environment."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = """
import json, os, signal, sys
from pathlib import Path
from scaletrain.bench import forked_runs
from scaletrain.bench.runner import run_logged
from scaletrain.errors import UserError

TRAIN = ["train", "model.preset=tiny", "data.seq_len=32", "train.micro_batch=1", "train.steps=2", "run.device=cpu"]

def main(out):
    seen = {}
    log = out / "ok.log"
    seen["ok"] = forked_runs.run([*TRAIN, f"run.dir={out / 'ok'}"], log)
    seen["ok_run"] = (out / "ok" / "checkpoints" / "step_2").is_dir() and "config" in log.read_text()
    import multiprocessing.forkserver as server
    seen["server"] = server._forkserver._forkserver_pid is not None
    # scaletrain's own variables reach the fork as they are now: the run is killed after step 1.
    os.environ["SCALETRAIN_KILL_AT"] = "step:1"
    seen["killed"] = forked_runs.run([*TRAIN, f"run.dir={out / 'killed'}"], out / "killed.log")
    del os.environ["SCALETRAIN_KILL_AT"]
    try:  # bad input: the CLI's one line and its exit code, which the bench reports
        run_logged([sys.executable, "-m", "scaletrain", "train", "model.preset=nope"], out / "bad.log", "the bad run")
    except UserError as e:
        seen["bad"] = str(e)
    # Where a fork could differ: a variable read at import, another working directory, a -c main.
    before = os.environ.get("ATEN_CPU_CAPABILITY")
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2" if before == "default" else "default"  # another than the server's
    seen["aten"] = forked_runs.run(["--version"], out / "a.log")
    os.environ.pop("ATEN_CPU_CAPABILITY")
    if before is not None:
        os.environ["ATEN_CPU_CAPABILITY"] = before
    here = os.getcwd()
    os.chdir(out)
    seen["cwd"] = forked_runs.run(["--version"], out / "b.log")
    os.chdir(here)
    main_module = sys.modules["__main__"]
    main_module.__file__ = "<string>"
    seen["dash_c"] = forked_runs.run(["--version"], out / "c.log")
    print(json.dumps(seen))

if __name__ == "__main__":
    main(Path(sys.argv[1]))
"""


def test_a_forked_run_has_its_exit_code_its_log_and_the_environment_of_now_and_where_it_could_differ_none(tmp_path):
    script = tmp_path / "forked_runs_check.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["ok"] == 0 and seen["ok_run"] and seen["server"], seen
    assert seen["killed"] == -9, seen  # SIGKILL, as an OOM killer would
    assert "(exit 2): scaletrain: error: config key model.preset = 'nope' is invalid" in seen["bad"], seen
    assert (seen["aten"], seen["cwd"], seen["dash_c"]) == (None, None, None), seen
