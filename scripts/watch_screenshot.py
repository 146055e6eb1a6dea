"""A screenshot of `scaletrain watch` for docs/telemetry.md: RUN_DIR's live view, served on a
free local port, rendered by headless Chromium (Debian's `chromium`, as the tests use it).

    .venv/bin/python scripts/watch_screenshot.py RUN_DIR docs/img/watch.png
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from scaletrain.diagnose.live import LiveReport, serve


def main(run_dir: str, out: str) -> int:
    chromium = shutil.which("chromium")
    if chromium is None:
        print("chromium is not installed (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    server = serve(LiveReport(run_dir), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
                 "--disable-background-networking", "--window-size=1200,1900", "--virtual-time-budget=3000",
                 f"--user-data-dir={profile}", f"--screenshot={Path(out).resolve()}",
                 f"http://127.0.0.1:{server.server_address[1]}/"],
                check=True, capture_output=True, timeout=120,
            )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
