"""Screenshots of the built docs site in headless Chromium (Debian's `chromium` package), to look at.

    mkdocs build --strict && python docs/screenshot.py            # writes site-shots/*.png

Serves ``site/`` on 127.0.0.1 and takes the home page and one API page (``api/pipeline/``) at
1280x2000. Chromium runs with the flags this machine needs (no sandbox as root, no background
networking: the network is closed). Prints each PNG's path and size.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = {"home": "", "api-pipeline": "api/pipeline/"}
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,2000",
)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no request log on stderr
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=ROOT / "site", help="the built site (default site/)")
    parser.add_argument("--out", type=Path, default=ROOT / "site-shots", help="where the PNGs go")
    args = parser.parse_args(argv)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("error: no chromium on PATH; on Debian: apt-get install chromium", file=sys.stderr)
        return 2
    if not (args.site / "index.html").exists():
        print(f"error: {args.site}/index.html is missing; run `mkdocs build --strict` first", file=sys.stderr)
        return 2
    handler = functools.partial(_Quiet, directory=str(args.site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        for name, path in PAGES.items():
            shot = args.out / f"{name}.png"
            with tempfile.TemporaryDirectory() as profile:
                url = f"http://127.0.0.1:{server.server_port}/{path}"
                subprocess.run(
                    [browser, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={shot}", url],
                    capture_output=True,
                    timeout=120,
                    check=True,
                )
            print(f"{shot} ({shot.stat().st_size:,} bytes) <- {url}")
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
