"""`marft ui` in a real browser: headless Chromium (Debian's package; `make test` installs it when
missing and running as root) driven by Playwright against a live `marft ui` process on a free port.

The README's screenshot is made by docs/make_ui_screenshot.py the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from marft_bridge.serving.process import free_port
from marft_bridge.store import TraceStore
from test_ui_api import big_episode, expected_edges, fill, tool_episode, write_runs

CHROMIUM_CANDIDATES = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def find_chromium() -> str | None:
    for path in CHROMIUM_CANDIDATES + [shutil.which("chromium") or ""]:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


@pytest.fixture(scope="module")
def chromium():
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    path = find_chromium()
    if path is None:
        pytest.skip("no Chromium found at /usr/bin/chromium (make test installs Debian's chromium package when run "
                    "as root: apt-get install -y chromium)")
    return path


@pytest.fixture
def live_ui(tmp_path):
    """A store with a captured supervisor episode and a hand-built tool episode, a training run, and
    `marft ui` serving them from its own process (stopped by pid)."""
    db = tmp_path / "traces.db"
    with TraceStore.open(db) as store:
        ids = fill(store)
        store.add_episode(big_episode())
    runs = tmp_path / "runs"
    write_runs(runs)
    state = tmp_path / "service"
    state.mkdir()
    (state / "decisions.jsonl").write_text(json.dumps(
        {"time": "2026-05-01T12:00:00+00:00", "round": 1, "decision": "promote", "reason": "gate passed"}) + "\n")
    with serving_ui(db, "--runs", str(runs), "--service-state", str(state), "--registry", str(tmp_path / "registry")) as url:
        yield url, db, ids


@contextlib.contextmanager
def serving_ui(db, *args: str):
    """`marft ui` on ``db`` in its own process on a free port (stopped by pid); yields its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "marft_bridge", "ui", "--store", str(db), *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/api/meta", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.stdout.read().decode() if proc.poll() is not None else ""
                    pytest.fail(f"marft ui did not start: {out}")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def browser_page(chromium, tmp_path):
    """A headless Chromium page; page errors and failed requests collect in ``page.failed``."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1500, "height": 1000})
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            expect.set_options(timeout=30_000)  # a shared, loaded CI machine: waits, not timing checks
            page.failed = []
            page.on("pageerror", lambda e: page.failed.append(str(e)))
            page.on("requestfailed", lambda r: page.failed.append(r.url))
            yield page
        finally:
            browser.close()


def test_browser_episode_list_graph_action_and_run_plot(chromium, live_ui, tmp_path):
    from playwright.sync_api import expect

    url, db, ids = live_ui
    with TraceStore.open(db) as store:
        episodes = {k: store.get_episode(v) for k, v in ids.items()}
    with browser_page(chromium, tmp_path) as page:
        # 1. The episode list: every stored episode, counts per agent.
        page.goto(url + "/#/episodes")
        expect(page.locator("body[data-ready=episodes]")).to_have_count(1)
        rows = page.locator("#episodes tbody tr[data-episode-id]")
        expect(rows).to_have_count(4)
        assert set(rows.evaluate_all("rs => rs.map(r => r.dataset.episodeId)")) == set(ids.values()) | {"big"}
        expect(page.locator('[data-counts=agent] .chip[data-value=planner]')).to_have_attribute("data-count", "2")

        # Live: an episode stored now appears without a reload.
        with TraceStore.open(db) as store:
            store.add_episode(tool_episode("arrived-later"))
        expect(page.locator('#episodes tr[data-episode-id="arrived-later"]')).to_have_count(1)
        expect(page.locator('#episodes tr[data-episode-id="arrived-later"]')).to_have_class("clickable new")

        # 2. The captured supervisor episode: one SVG node per action, one edge per dependency.
        page.locator(f'#episodes tr[data-episode-id="{ids["captured"]}"] a').click()
        expect(page.locator("body[data-ready=episode]")).to_have_count(1)
        ep = episodes["captured"]
        expect(page.locator("#graph .node[data-action-id]")).to_have_count(len(ep.actions))
        expect(page.locator("#graph path.edge")).to_have_count(len(expected_edges(ep)))
        drawn = page.locator("#graph path.edge").evaluate_all("es => es.map(e => [e.dataset.from, e.dataset.to])")
        assert {tuple(e) for e in drawn} == expected_edges(ep)
        asked = next(a for a in ep.actions if a.output.tool_calls)
        page.locator(f'#graph .node[data-action-id="{asked.id}"]').click()
        name = asked.output.tool_calls[0]["function"]["name"]
        expect(page.locator(f'#action-detail #output [data-tool-call="{name}"]')).to_be_visible()

        # 3. The hand-built episode: tool kinds drawn apart, the credited path, a tool call, tokens.
        page.goto(url + "/#/episode/tool-episode-1")
        expect(page.locator("body[data-ready=episode]")).to_have_count(1)
        expect(page.locator("#graph .node[data-action-id]")).to_have_count(4)
        expect(page.locator("#graph path.edge")).to_have_count(3)
        expect(page.locator("#graph .node.kind-tool")).to_have_count(1)
        expect(page.locator("#graph .node.kind-tool polygon")).to_have_count(1)  # its own shape
        expect(page.locator("#graph .node.credited")).to_have_count(3)  # the team reward's path
        expect(page.locator("#graph path.edge.credited")).to_have_count(3)
        page.locator("#rewards tr.clickable").nth(1).click()  # the tool step's own reward
        expect(page.locator("#graph .node.credited")).to_have_count(2)
        page.locator('#graph .node[data-action-id="plan"]').click()
        call = page.locator('#action-detail #output [data-tool-call="search"]')
        expect(call).to_contain_text('{"query": "cats"}')
        expect(page.locator("#tokens")).to_have_attribute("data-token-source", "server")
        expect(page.locator("#tokens .tok")).to_have_count(3)
        expect(page.locator("#action-detail")).to_contain_text("planner v2")
        expect(page.locator("#action-detail")).to_contain_text("temperature")
        page.locator('#graph .node[data-action-id="search-1"]').click()
        expect(page.locator('#action-detail #observation [data-tool-call="search"]')).to_be_visible()
        expect(page.locator("#tokens")).to_contain_text("not a model call")
        page.locator('#graph .node[data-action-id="plan"]').click()
        expect(page.locator("#tokens .tok")).to_have_count(3)
        stray = "p => [p, ...p.querySelectorAll('*')].flatMap(e => [...e.childNodes]).filter(n => n.nodeType === 3 && n.textContent === 'null').length"
        assert page.locator("#action-detail").evaluate(stray) == 0  # no empty section printed as "null"
        shot = tmp_path / "ui-episode.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000

        # 4. 10k actions: the graph collapses to one node per (step, agent); a node lists its actions.
        page.goto(url + "/#/episode/big")
        expect(page.locator("body[data-ready=episode]")).to_have_count(1)
        expect(page.locator("#graph.collapsed .node[data-group]")).to_have_count(1000)
        expect(page.locator("#actions tbody tr")).to_have_count(100)  # the first page of the list
        page.locator('#graph .node[data-group="3/b"]').click()
        expect(page.locator("#actions tbody tr")).to_have_count(10)
        page.locator('#actions tr[data-action-id="x121"]').click()
        expect(page.locator("#action-detail")).to_contain_text("Action #121: b")

        # 5. The training run's plots.
        page.goto(url + "/#/runs")
        page.locator("#runs tr[data-run]").first.click()
        plot = page.locator('#plots svg.plot[data-metric="reward_mean"]')
        expect(plot).to_have_attribute("data-points", "3")
        expect(page.locator('#plots svg.plot[data-metric="skipped.no_reward"]')).to_have_count(1)
        expect(plot.locator("polyline.series")).to_have_count(1)
        page.screenshot(path=str(tmp_path / "ui-run.png"), full_page=True)

        # 6. Adapters: the service's decisions (no registry here).
        page.goto(url + "/#/adapters")
        expect(page.locator("#decisions")).to_contain_text("gate passed")
        assert page.failed == []

# Ids as capture makes them: 12 hex digits of milliseconds, then random ones. Captured in the same
# minute they share their first 8 digits; two here even share their last 8.
SAME_MINUTE = ["01a2334455ab" + "c0ffee0000" + "deadbeef", "01a2334455ab" + "c0ffee0001" + "deadbeef",
               "01a2334455ab" + "0123456789" + "abcdef01"]


def test_browser_short_ids_tell_episodes_and_actions_apart_and_an_unreadable_row_is_a_banner(chromium, tmp_path):
    from playwright.sync_api import expect

    from marft_bridge.schema import Action, Episode, Reward
    from test_store_limits import good_episode, spoil

    db = tmp_path / "traces.db"
    with TraceStore.open(db) as store:
        for k, eid in enumerate(SAME_MINUTE):
            first, second = f"{eid[:12]}{k:04x}aaaa000011112222", f"{eid[:12]}{k:04x}bbbb000011112222"
            store.add_episode(Episode(id=eid, actions=[
                Action(id=first, agent="planner", output={"text": "plan"}),
                Action(id=second, agent="coder", step=1, depends_on=[first], output={"text": "code"})],
                rewards=[Reward(value=1.0, action_id=second)]))
        store.add_episode(good_episode(0, eid="spoiled"))
    spoil(f"sqlite:///{db}", "spoiled", "torn")
    assert len({i[:8] for i in SAME_MINUTE}) == 1  # what the list used to show for all three
    with serving_ui(db) as url, browser_page(chromium, tmp_path) as page:
        page.goto(url + "/#/episodes")
        expect(page.locator("body[data-ready=episodes]")).to_have_count(1)
        expect(page.locator("#episodes tbody tr[data-episode-id]")).to_have_count(3)
        expect(page.locator("#unreadable")).to_have_attribute("data-count", "1")
        expect(page.locator("#unreadable")).to_contain_text("moved to the dead letters")
        links = page.locator("#episodes tbody tr[data-episode-id] td:first-child a")
        shown = links.evaluate_all("as => as.map(a => [a.textContent, a.title, a.getAttribute('href')])")
        assert sorted(map(tuple, shown)) == sorted([("…0deadbeef", SAME_MINUTE[0], f"#/episode/{SAME_MINUTE[0]}"),
                                        ("…1deadbeef", SAME_MINUTE[1], f"#/episode/{SAME_MINUTE[1]}"),
                                        ("…abcdef01", SAME_MINUTE[2], f"#/episode/{SAME_MINUTE[2]}")])

        # Within an episode, actions are #k; the full id is on hover and in the link.
        eid = SAME_MINUTE[1]
        first = f"{eid[:12]}0001aaaa000011112222"
        page.locator(f'#episodes tr[data-episode-id="{eid}"] a').click()
        expect(page.locator("body[data-ready=episode]")).to_have_count(1)
        dep = page.locator("#actions tbody tr").nth(1).locator("td").nth(5).locator("span")
        expect(dep).to_have_text("#0")
        expect(dep).to_have_attribute("title", first)
        reward_for = page.locator("#rewards tr.clickable td").nth(1)
        expect(reward_for).to_have_text("action #1")
        page.locator("#actions tbody tr").nth(1).click()
        link = page.locator("#action-detail a.mono").first
        expect(link).to_have_text("#0")
        expect(link).to_have_attribute("title", first)
        assert first in link.get_attribute("href")
        assert page.failed == []
