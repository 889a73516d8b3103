"""Make the README's `marft ui` screenshot (docs/ui-episode.png) from a freshly captured episode.

    .venv/bin/python docs/make_ui_screenshot.py docs/ui-episode.png

Captures examples/mcp_tools/run.py's episode (a LangGraph agent whose tool calls go to an MCP
server, the server's own tool steps joined in) into a new SQLite store, gives it a team reward,
writes a small metrics.jsonl, starts `marft ui` on a free port and screenshots the episode page
with the model call that asked for the tools selected, in Debian's headless chromium.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def main(out: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    from marft_bridge.serving.process import free_port
    from marft_bridge.store import TraceStore

    tmp = Path(tempfile.mkdtemp(prefix="marft-ui-shot-"))
    db = tmp / "traces.db"
    subprocess.run([sys.executable, str(ROOT / "examples/mcp_tools/run.py"), "--store", str(db)], check=True,
                   stdout=subprocess.DEVNULL)
    with TraceStore.open(db) as store:
        (row,) = store.episode_rows(limit=1, newest_first=True)
        ep = store.get_episode(row["id"])
        store.add_reward(ep.id, 1.0, source="checker")
    asked = next(a for a in ep.actions if a.output.tool_calls)
    run = tmp / "runs" / "marft-a-s0"
    run.mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:
        for u in range(1, 9):
            f.write(json.dumps({"update": u, "reward_mean": 0.3 + 0.05 * u, "kl_ref": 0.002 * u,
                                "entropy": 1.6 - 0.04 * u, "value_loss": 0.8 / u, "clipfrac": 0.02 * u}) + "\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "marft_bridge", "ui", "--store", str(db), "--runs",
                             str(tmp / "runs"), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/api/meta", timeout=2).close()
                break
            except OSError:
                time.sleep(0.2)
        with sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(
                str(tmp / "profile"), executable_path="/usr/bin/chromium", headless=True, args=ARGS,
                viewport={"width": 1440, "height": 1060})
            page = browser.new_page()
            page.goto(f"{url}/#/episode/{ep.id}?action={asked.id}")
            expect(page.locator("#action-detail #output [data-tool-call]").first).to_be_visible()
            page.screenshot(path=str(out))
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    print(f"{out}: episode {ep.id} ({len(ep.actions)} actions)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "docs" / "ui-episode.png"))
