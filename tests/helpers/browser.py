"""Headless Chromium, to render the pages diagnose writes."""

from __future__ import annotations

import shutil
from pathlib import Path

from helpers.launch import run

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
    return render_url_in_chromium(page.resolve().as_uri(), tmp)


def render_url_in_chromium(url: str, tmp: Path) -> str:
    """Render `url` in headless Chromium for its virtual-time budget (timers run, and the
    clock waits while a fetch is pending): asserts a full-size screenshot was produced and
    returns the DOM as it is at the end."""
    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed: `make test` installs it (apt-get install chromium) on a fresh machine"
    png = tmp / "page.png"
    args = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'chromium-profile'}", f"--screenshot={png}", "--dump-dom"]
    # run(): a timeout, and chromium's zygote and renderers are killed with it
    proc = run([*args, url], timeout=90, one_thread=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000, len(data)
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (1280, 2400)
    return proc.stdout
