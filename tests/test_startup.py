"""launch/startup.py: a process the CLI owns imports torch and the engine with the cyclic collector
paused, freezes what the imports made, and runs with the collector on; any other process
keeps its collector as it was. Each case runs in a fresh interpreter: a freeze is for the
life of a process, and this one is pytest's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def _python(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


BLOCK = """
import gc, json
from scaletrain.launch import startup
{before}
with startup.heavy_imports():
    inside = gc.isenabled()
    import torch
print(json.dumps({{"inside": inside, "after": gc.isenabled(), "frozen": gc.get_freeze_count()}}))
"""


def test_an_owned_process_imports_without_the_collector_then_freezes_and_turns_it_back_on():
    seen = _python(BLOCK.format(before="startup.own_process()"))
    assert seen["inside"] is False and seen["after"] is True
    assert seen["frozen"] > 100_000  # torch's import alone makes ~170k tracked objects


@pytest.mark.parametrize("before", ["", "startup.own_process(); gc.disable()"], ids=["not-owned", "collector-already-off"])
def test_a_process_the_cli_does_not_own_or_whose_collector_is_off_is_left_as_it_was(before):
    seen = _python(BLOCK.format(before=before))
    assert seen["frozen"] == 0
    assert seen["inside"] is seen["after"] is (before == "")


def test_scaletrain_train_reaches_the_trainer_with_torch_dynamo_and_the_engine_frozen_and_the_collector_on():
    # The trainer replaced by a spy (nothing trains): what `scaletrain train` hands it. The
    # spy is installed before main() runs, so the trainer's own import happens earlier, as
    # a plain import; the engine's module and torch._dynamo are the CLI's (engines.preload).
    seen = _python(
        """
import gc, json, sys
import scaletrain.training.trainer as trainer
def spy(cfg, console=None):
    print(json.dumps({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                      "preloaded": [m in sys.modules for m in ("torch._dynamo", "scaletrain.engines.fsdp")]}))
trainer.train = spy
from scaletrain.cli import main
sys.argv = ["scaletrain", "train", "model.preset=tiny", "parallel.strategy=fsdp", "run.device=cpu"]
main()
"""
    )
    assert seen["enabled"] is True
    assert seen["frozen"] > 100_000
    assert seen["preloaded"] == [True, True]


SCRIPT = """
import json, os, signal, sys
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "marker": os.environ.get("FORK_TEST_MARKER"),
    "tag": "SCALETRAIN_TEST_TAG" in os.environ, "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler, "stdin": sys.stdin.read(),
    "main": __name__, "session_leader": os.getsid(0) == os.getpid(),
}))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def test_a_command_forked_by_the_tests_server_sees_what_a_new_process_does(tmp_path, monkeypatch):
    """tests/forkserver.py: the same argv, sys.path, working directory, environment,
    signal handlers, stdin, output and exit status as the new process Popen would start."""
    import forkserver
    from helpers import launch

    # A server of its own, started from this environment as it is now: what earlier tests
    # in this process left in os.environ cannot make it decline the command.
    monkeypatch.setattr(launch, "_forks", forkserver.Client())
    script = tmp_path / "probe_me.py"
    script.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    cmd = [sys.executable, str(script), "a", "b c"]
    forked = launch.Launched(cmd, env={"FORK_TEST_MARKER": "x"})
    assert type(forked.proc).__name__ == "Forked"  # the server took it (nothing here differs at import)
    done = forked.wait(60)
    new = launch.run(cmd, env={"FORK_TEST_MARKER": "x"}, timeout=60, new_process=True)
    assert (done.returncode, done.stderr) == (new.returncode, new.stderr) == (3, "to stderr\n")
    seen, want = json.loads(done.stdout), json.loads(new.stdout)
    assert seen == want and want["marker"] == "x" and want["argv"] == [str(script), "a", "b c"], (seen, want)
    assert want["sigterm"] and want["session_leader"] and want["cwd"] == str(tmp_path)
    # Python's KeyboardInterrupt handler, unless this process was started with SIGINT ignored
    # (in a shell's background job), which both then inherit.
    assert want["sigint"] == (signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)


RANK_SCRIPT = """
import json, os, signal, sys
out, *rest = sys.argv[1:]
with open(os.path.join(out, "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump({"argv": rest, "path0": sys.path[0], "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"],
               "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "main": __name__,
               "unbuffered": sys.stdout.write_through}, f)
if "fail" in rest and os.environ["RANK"] == "1":
    sys.exit(3)
"""


def test_a_probes_ranks_forked_from_torchruns_agent_see_what_new_processes_do(tmp_path, monkeypatch):
    """helpers.launch.torchrun: a probe's ranks forked from the agent (helpers/forked_rank.py)
    see the argv, sys.path, environment, signal handlers and unbuffered output that torchrun's
    new processes (`python -u SCRIPT`) see, and a rank's failure fails the launch."""
    from helpers.launch import run, torchrun

    script = tmp_path / "rank_probe.py"
    script.write_text(RANK_SCRIPT)
    seen = {}
    for start in ("fork", "exec"):
        monkeypatch.setenv("SCALETRAIN_RANK_START", start)
        cmd = torchrun([str(script), str(tmp_path / start), "a", "b c"], 2)
        assert ("--run-path" in cmd) == (start == "fork"), cmd
        (tmp_path / start).mkdir()
        done = run(cmd, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        seen[start] = [json.loads((tmp_path / start / f"rank{r}.json").read_text()) for r in range(2)]
        failed = run(torchrun([str(script), str(tmp_path / start), "fail"], 2), timeout=120)
        assert failed.returncode != 0, failed.stderr[-3000:]
    assert seen["fork"] == seen["exec"], seen
    assert [r["rank"] for r in seen["fork"]] == ["0", "1"] and seen["fork"][0]["argv"] == ["a", "b c"]
    assert seen["fork"][0]["path0"] == str(tmp_path) and seen["fork"][0]["sigterm"] and seen["fork"][0]["unbuffered"]
