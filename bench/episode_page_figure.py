"""docs/figures/episode_page.png: the top of a run's episode page (`megatron-agent show`) in
headless Chromium (Debian's: `make chromium`), at the newest iteration.

    python bench/episode_page_figure.py RUN_DIR [OUT]   # OUT: docs/figures/episode_page.png
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path, nargs="?", default=ROOT / "docs" / "figures" / "episode_page.png")
    parser.add_argument("--width", type=int, default=1100)
    parser.add_argument("--height", type=int, default=1000)
    args = parser.parse_args()

    from playwright.sync_api import sync_playwright

    from megatron_agent.episode_page import write_episode_page

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("error: no Chromium on this machine: `make chromium` installs Debian's", file=sys.stderr)
        return 2
    page_file = write_episode_page(args.run_dir, args.run_dir / "episodes.html")
    errors = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        page = browser.new_page(viewport={"width": args.width, "height": args.height})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.goto(page_file.resolve().as_uri())
        page.wait_for_load_state("load")
        page.screenshot(path=str(args.out))
        browser.close()
    if errors:
        print(f"error: the page logged errors: {errors}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} (the page: {page_file})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
