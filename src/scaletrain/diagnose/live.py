"""`scaletrain watch RUN`: the run's report (report.py: findings and plots), served on
localhost and brought up to date while metrics.jsonl grows.

The page is the report with a status line and a few lines of inline script: every
`every` seconds it asks `/state` (a small JSON: the files' sizes and times, the last step,
whether the run has ended), and when the files changed it fetches `/fragment` (the findings
and plots rendered again) into the page; once the run has ended it stops asking. Its
Content-Security-Policy allows that script and requests to this server only: no fetch
leaves the machine. Only files are read, never written (report.html is `diagnose`'s), so a
training run never waits on a watcher, and several may watch one run directory (a shared
disk seen from any node).

A run has ended when its last step row is its config's train.steps; until then the status
says the step, its loss and how long ago the last row came.
"""

from __future__ import annotations

import html
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from scaletrain.diagnose.run import Run, load_run
from scaletrain.errors import UserError

FILES = ("metrics.jsonl", "ranks.jsonl", "run.json", "config.yaml")
POLICY = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; connect-src 'self'"
_SCRIPT = """
<script>
(function () {
  var seen = %(version)s, every = %(every)d;
  function poll() {
    fetch("/state", {cache: "no-store"}).then(function (r) { return r.json(); }).then(function (s) {
      var status = document.getElementById("live-status");
      status.textContent = s.status;
      status.dataset.ended = s.ended ? "1" : "0";
      if (s.version === seen) { return s; }
      return fetch("/fragment", {cache: "no-store"}).then(function (r) { return r.text(); }).then(function (t) {
        document.getElementById("live").innerHTML = t;
        seen = s.version;
        return s;
      });
    }).then(function (s) { if (!s || !s.ended) { setTimeout(poll, every); } },
            function () { setTimeout(poll, every); });
  }
  setTimeout(poll, every);
})();
</script>
"""


class LiveReport:
    """What the server answers, from the run directory's files as they are now; a render is
    kept until the files change."""

    def __init__(self, run_dir: str | Path, every_s: float = 2.0):
        self.root = Path(run_dir)
        self.every_ms = max(100, int(every_s * 1000))
        run = load_run(self.root)  # one line if it is no run directory
        if not run.steps and not (self.root / "metrics.jsonl").is_file():
            raise UserError(
                f"{run_dir} holds no metrics.jsonl yet; accepted: a run directory whose run has logged its first interval"
            )
        self._lock = threading.Lock()
        self._cached: tuple[str, str] | None = None

    def version(self) -> str:
        """The files' sizes and modification times: what changes when a row is appended."""
        parts = []
        for name in FILES:
            try:
                st = (self.root / name).stat()
                parts.append(f"{st.st_size}:{st.st_mtime_ns}")
            except FileNotFoundError:
                parts.append("-")
        return "/".join(parts)

    def state(self) -> dict[str, Any]:
        run = load_run(self.root)
        return {"version": self.version(), **status(run)}

    def fragment(self) -> str:
        """The findings and plots as the files say now (rendered once per version)."""
        with self._lock:
            version = self.version()
            if self._cached is None or self._cached[0] != version:
                from scaletrain.diagnose.findings import diagnose_run
                from scaletrain.diagnose.report import render_body

                run = load_run(self.root)
                self._cached = (version, render_body(run, diagnose_run(run)))
            return self._cached[1]

    def page(self) -> str:
        from scaletrain.diagnose.report import page_head

        body = self.fragment()  # first: its version is the one the script starts from
        state = self.state()
        run = load_run(self.root)
        e = html.escape
        line = (
            f'<p class="meta">live: <span id="live-status" data-ended="{int(state["ended"])}">{e(state["status"])}</span> '
            f"&middot; updated every {self.every_ms / 1000:g} s from {e(str(self.root.resolve()))}</p>\n"
        )
        script = _SCRIPT % {"version": json.dumps(self._cached[0] if self._cached else ""), "every": self.every_ms}
        return page_head(run, POLICY) + line + f'<div id="live">{body}</div>\n' + script + "</body></html>\n"


def status(run: Run) -> dict[str, Any]:
    """Whether the run has ended, and the status line's text."""
    last = run.steps[-1] if run.steps else None
    total = run.config.train.steps if run.config is not None else None
    if last is None:
        return {"ended": False, "step": 0, "status": "waiting for the first step row"}
    step = int(last["step"])
    loss = last.get("loss")
    said = f"loss {loss:.4f}" if isinstance(loss, int | float) else "no loss"
    try:
        ago = time.time() - (run.root / "metrics.jsonl").stat().st_mtime
    except FileNotFoundError:
        ago = 0.0
    if total is not None and step >= total:
        return {"ended": True, "step": step, "status": f"ended at step {step} of {total} ({said})"}
    of = f" of {total}" if total is not None else ""
    return {"ended": False, "step": step, "status": f"running: step {step}{of}, {said}; last row {ago:.0f} s ago"}


def serve(live: LiveReport, host: str, port: int) -> ThreadingHTTPServer:
    """A server for `live` on host:port (0: any free port), not yet serving; one line if the
    port is taken."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            try:
                if path == "/":
                    self._send(live.page(), "text/html; charset=utf-8")
                elif path == "/state":
                    self._send(json.dumps(live.state()), "application/json")
                elif path == "/fragment":
                    self._send(live.fragment(), "text/html; charset=utf-8")
                else:
                    self.send_error(404)
            except UserError as e:  # the run directory went away while watched
                self.send_error(410, str(e))

        def _send(self, text: str, kind: str) -> None:
            data = text.encode("utf-8")
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # every poll would be a line

    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is no port; accepted: 1-65535, or 0 for any free one")
    try:
        return ThreadingHTTPServer((host, port), Handler)
    except OSError as e:
        raise UserError(
            f"cannot serve on {host}:{port} ({e.strerror or e}); accepted: another --port (0: any free one), or a --host of this machine"
        ) from None
