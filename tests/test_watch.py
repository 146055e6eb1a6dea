"""`scaletrain watch RUN` (diagnose/live.py): the report served on localhost, a row appended
to metrics.jsonl shown without a reload (in headless Chromium), a run that ends shown as
ended, and the one-line refusals."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest

from scaletrain.diagnose.live import LiveReport, serve
from scaletrain.errors import UserError

from helpers.browser import render_url_in_chromium
from helpers.launch import one_line_error, scaletrain


def step_row(step):
    return {"step": step, "loss": 10.0 - step / 2, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1000.0,
            "step_time_s": 1.0, "tokens": 1000 * step}  # fmt: skip


def append(run, rows):
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def half_run(tmp_path):
    """A run directory as a 10-step run leaves it after step 5."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"engine": "ddp", "world_size": 1, "device": "cpu"}))
    (run / "config.yaml").write_text("train:\n  steps: 10\n")
    append(run, [step_row(s) for s in range(1, 6)])
    return run


@pytest.mark.unit
def test_the_state_follows_the_file_and_says_when_the_run_ended(half_run):
    live = LiveReport(half_run)
    before = live.state()
    assert not before["ended"] and before["status"].startswith("running: step 5 of 10, loss 7.5000; last row ")
    fragment = live.fragment()
    assert 'id="plot-loss"' in fragment and live.fragment() is fragment  # rendered once per version
    append(half_run, [step_row(s) for s in range(6, 11)])
    after = live.state()
    assert after["version"] != before["version"] and after["ended"] and after["status"] == "ended at step 10 of 10 (loss 5.0000)"
    assert live.fragment() is not fragment
    page = live.page()
    assert "connect-src 'self'" in page and 'id="live-status" data-ended="1"' in page
    assert not (half_run / "report.html").exists()  # a watcher writes nothing into the run directory


class AppendsOnFirstLook(LiveReport):
    """The run writes its last five steps once the page has asked for the state once."""

    def state(self):
        if not getattr(self, "appended", False):
            self.appended = True
            first = super().state()
            append(self.root, [step_row(s) for s in range(6, 11)])
            return first
        return super().state()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_page_updates_without_a_reload_and_shows_the_end(half_run, tmp_path):
    server = serve(AppendsOnFirstLook(half_run, every_s=0.2), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dom = render_url_in_chromium(f"http://127.0.0.1:{server.server_address[1]}/", tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    # Loaded at step 5; the rows of steps 6-10 came after: the page fetched them by itself.
    assert 'data-ended="1"' in dom and "ended at step 10 of 10 (loss 5.0000)" in dom, dom[:3000]
    assert 'id="plot-loss"' in dom


@pytest.mark.unit
def test_what_it_refuses_is_one_line(half_run, tmp_path):
    with pytest.raises(UserError, match=r"is not a directory; accepted: a run directory"):
        LiveReport(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "run.json").write_text("{}")
    with pytest.raises(UserError, match=r"holds no metrics.jsonl yet; accepted: a run directory whose run has logged"):
        LiveReport(tmp_path / "empty")
    with pytest.raises(UserError, match=r"--port 70000 is no port; accepted: 1-65535, or 0"):
        serve(LiveReport(half_run), "127.0.0.1", 70000)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_port_in_use_is_one_line(half_run):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = scaletrain(["watch", str(half_run), "--port", str(port)])
    one_line_error(proc, f"cannot serve on 127.0.0.1:{port} (Address already in use); accepted: another --port")


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "kill"])
def test_ctrl_c_or_a_kill_ends_it_with_0_also_where_sigint_started_ignored(half_run, stop):
    # A background job of a script (or nohup) starts with SIGINT ignored, and Python then
    # installs no handler: the watcher served on after Ctrl-C (the README test, run so).
    # A new process, not the suite's fork: its signal dispositions are what is tested.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "watch", str(half_run), "--port", str(port)],
        stdout=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        assert proc.stdout is not None and "watching" in proc.stdout.readline()  # serving from here on
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:
            assert page.status == 200
        proc.send_signal(stop)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
