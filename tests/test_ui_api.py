"""`marft ui` API: every endpoint on SQLite and PostgreSQL stores holding a captured supervisor-style
LangGraph episode (fake chat models emitting real tool calls) and a hand-built episode with tool
steps; D drawn exactly; bad ids, traversal, write methods, keys and non-loopback binds refused.

The builders here are shared with tests/test_ui_browser.py.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

import marft_bridge as mb
from marft_bridge.cli import main as marft
from marft_bridge.errors import RecordError
from marft_bridge.schema import Action, Episode, Observation, Reward

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=timezone.utc)
BOUND_TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
METRIC_ROWS = [
    {"update": 1, "reward_mean": 0.25, "kl_ref": 0.0, "entropy": 1.5, "value_loss": 0.9, "clipfrac": 0.0,
     "factor_mean": 1.0, "skipped": {"no_reward": 2}, "flagged": {"no_behaviour_logprobs": 1}, "agent_order": ["a"]},
    {"update": 2, "reward_mean": 0.5, "kl_ref": 0.01, "entropy": 1.4, "value_loss": 0.6, "clipfrac": 0.1,
     "factor_mean": 0.97, "skipped": {"no_reward": 0}, "flagged": {"no_behaviour_logprobs": 0}, "agent_order": ["a"]},
    {"update": 3, "reward_mean": 0.75, "kl_ref": 0.02, "entropy": 1.3, "value_loss": 0.4, "clipfrac": 0.2,
     "factor_mean": 0.95, "skipped": {"no_reward": 1}, "flagged": {"no_behaviour_logprobs": 0}, "agent_order": ["a"]},
]


def capture_supervisor_episode(store) -> str:
    """A langgraph-supervisor app: the supervisor hands off to a ReAct researcher whose model calls
    the `search` tool; both models are fakes that emit real tool calls. Returns the episode id."""
    from langchain.agents import create_agent
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool
    from langgraph_supervisor import create_supervisor

    class ToolModel(GenericFakeChatModel):
        def bind_tools(self, tools, **kwargs):
            return self

    @tool
    def search(query: str) -> str:
        """Search the web."""
        return f"results for {query}: cats are mammals"

    supervisor = ToolModel(messages=iter([
        AIMessage("", tool_calls=[{"name": "transfer_to_researcher", "args": {}, "id": "call_t1"}]),
        AIMessage("Cats are mammals.")]))
    researcher = ToolModel(messages=iter([
        AIMessage("", tool_calls=[{"name": "search", "args": {"query": "cats"}, "id": "call_s1"}]),
        AIMessage("Cats are mammals (source: search).")]))
    worker = create_agent(researcher, [search], name="researcher")
    app = mb.instrument(create_supervisor([worker], model=supervisor).compile(), store=store,
                        source="langgraph-supervisor", reward_fn=lambda inputs, outputs: 1.0)
    app.invoke({"messages": [HumanMessage("what are cats?")]})
    store.flush()
    return app.last_episode_id


def tool_episode(episode_id: str = "tool-episode-1", reward: float = 0.5, planner_version: int = 2) -> Episode:
    """planner asks for `search` -> the tool step runs it -> writer answers from both; a team reward
    and one on the tool step. Token ids and behaviour log-probs as a vLLM-style server reports them."""
    obs = {"messages": [{"role": "system", "content": "You plan."}, {"role": "user", "content": "What are cats?"}]}
    if "tools" in Observation.model_fields:  # bound tools (schema version 2)
        obs["tools"] = BOUND_TOOLS
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"query": "cats"}'}}
    plan = Action(id="plan", agent="planner", step=1, kind="llm", observation=obs,
                  output={"text": "", "tool_calls": [call], "token_ids": [5, 17, 3], "logprobs": [-0.05, -1.2, -7.5],
                          "finish_reason": "tool_calls"},
                  sampling={"temperature": 0.7, "top_p": 0.9, "max_tokens": 64},
                  policy={"name": "planner", "version": planner_version}, started_at=T0,
                  ended_at=T0 + timedelta(seconds=0.25))
    run = Action(id="search-1", agent="tools", step=2, kind="tool", depends_on=["plan"],
                 observation={"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]},
                 output={"text": "cats are mammals"}, metadata={"latency_s": 0.01})
    write = Action(id="write", agent="writer", step=3, kind="llm", depends_on=["plan", "search-1"],
                   observation={"messages": [{"role": "user", "content": "What are cats?"},
                                             {"role": "assistant", "content": None, "tool_calls": [call]},
                                             {"role": "tool", "content": "cats are mammals", "tool_call_id": "call_1"}]},
                   output={"text": "Cats are mammals."}, policy={"name": "writer", "version": 1})
    side = Action(id="side", agent="planner", step=3, kind="env", output={"text": "log written"})
    return Episode(id=episode_id, source="manual", task={"question": "What are cats?"}, actions=[plan, run, write, side],
                   rewards=[Reward(value=reward, source="checker"), Reward(value=0.2, action_id="search-1", source="judge")],
                   started_at=T0)


def failed_episode() -> Episode:
    a = Action(id="oops", agent="planner", step=0, error="model timed out", policy={"name": "planner", "version": 1})
    return Episode(id="failed-episode", source="other", task="summarise the zebra report", actions=[a],
                   status="failed", started_at=T0 + timedelta(hours=1))


def write_runs(root: Path) -> Path:
    run = root / "marft-a-s0"
    run.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in METRIC_ROWS) + '{"update": 4, "reward_me'  # torn last line
    (run / "metrics.jsonl").write_text(text)
    return run


def fill(store) -> dict[str, str]:
    store.add_episode(tool_episode())
    store.add_episode(failed_episode())
    return {"captured": capture_supervisor_episode(store), "tool": "tool-episode-1", "failed": "failed-episode"}


def client_for(app, base_url: str = "http://127.0.0.1"):
    """A client once the app has indexed the store (it reads it beside serving)."""
    from fastapi.testclient import TestClient

    assert app.state.index.ready.wait(60) and app.state.index.scan_error is None
    return TestClient(app, base_url=base_url)


@pytest.fixture
def ui(store, tmp_path):
    from marft_bridge.ui.app import create_app

    ids = fill(store)
    runs = tmp_path / "runs"
    write_runs(runs)
    state = tmp_path / "service"
    state.mkdir()
    app = create_app(store, registry=tmp_path / "no-registry", runs=[runs], service_state=state)
    return client_for(app), ids, store


# -- episodes --------------------------------------------------------------------------------------


def test_episode_list_filters_counts_search_and_paging(ui):
    c, ids, _ = ui
    d = c.get("/api/episodes").json()
    assert d["total"] == d["stored"] == 3 and d["indexing"] is None
    assert [r["id"] for r in d["items"]][-2:] == ["failed-episode", "tool-episode-1"]  # newest first
    assert d["counts"]["agents"]["planner"] == 2
    assert {k: d["counts"]["versions"][k] for k in ("planner:v1", "planner:v2", "writer:v1")} == {
        "planner:v1": 1, "planner:v2": 1, "writer:v1": 1}
    assert d["counts"]["sources"] == {"manual": 1, "other": 1, "langgraph-supervisor": 1}

    def ids_of(**q):
        return {r["id"] for r in c.get("/api/episodes", params=q).json()["items"]}

    assert ids_of(source="manual") == {"tool-episode-1"}
    assert ids_of(agent="writer") == {"tool-episode-1"}
    assert ids_of(status="failed") == {"failed-episode"}
    assert ids_of(has_reward="false") == {"failed-episode"}
    assert ids_of(has_reward="true") == {"tool-episode-1", ids["captured"]}
    assert ids_of(reward_min="0.9") == {ids["captured"]}  # reward_fn gave 1.0; the tool episode's team reward is 0.5
    assert ids_of(reward_min="0.4", reward_max="0.6") == {"tool-episode-1"}
    assert ids_of(version="planner:v2") == {"tool-episode-1"}
    assert ids_of(errors="true") == {"failed-episode"}
    assert ids_of(q="ZEBRA") == {"failed-episode"}  # task text, case-insensitive
    assert ids_of(q=ids["captured"][:10]) == {ids["captured"]}
    assert ids_of(since=(T0 + timedelta(minutes=30)).isoformat(), until=(T0 + timedelta(hours=2)).isoformat()) == {"failed-episode"}
    assert ids_of(since="1d") == {ids["captured"]}  # an age: only the episode captured just now
    assert ids_of(until="1d") == {"tool-episode-1", "failed-episode"}
    page = c.get("/api/episodes", params={"limit": 1, "offset": 1}).json()
    assert page["total"] == 3 and len(page["items"]) == 1
    row = next(r for r in d["items"] if r["id"] == "tool-episode-1")
    assert (row["reward"], row["n_actions"], row["kinds"]) == (0.5, 4, {"llm": 2, "tool": 1, "env": 1})
    for bad in ({"limit": 0}, {"limit": 201}, {"offset": -1}, {"reward_min": "x"}, {"since": "yesterday"},
                {"has_reward": "maybe"}):
        r = c.get("/api/episodes", params=bad)
        assert r.status_code == 400, bad
        assert list(bad)[0] in r.json()["error"] or "limit" in r.json()["error"]


def test_list_is_served_while_the_store_is_read(store):
    import threading
    import time

    from fastapi.testclient import TestClient

    from marft_bridge.ui.app import create_app

    class PausingStore:
        """The real store, whose full scan stops after its first episode until told to go on."""

        def __init__(self, inner):
            self.inner, self.go = inner, threading.Event()

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def episodes(self, **filters):
            it = self.inner.episodes(**filters)
            yield next(it)
            self.go.wait(30)
            yield from it

    store.add_episode(tool_episode())
    store.add_episode(failed_episode())
    slow = PausingStore(store)
    app = create_app(slow)
    c = TestClient(app, base_url="http://127.0.0.1")
    for _ in range(100):
        d = c.get("/api/episodes").json()
        if d["stored"]:
            break
        time.sleep(0.05)
    assert d["indexing"] == {"indexed": 1, "total": 2, "error": None}
    assert [r["id"] for r in d["items"]] == ["failed-episode"]  # read newest first
    slow.go.set()
    assert app.state.index.ready.wait(30)
    d = c.get("/api/episodes").json()
    assert d["indexing"] is None and d["total"] == 2


def expected_edges(ep: Episode) -> set[tuple[str, str]]:
    return {(d, a.id) for a in ep.actions for d in a.depends_on}


def test_episode_graph_is_D(ui):
    c, ids, store = ui
    for eid in ids.values():
        ep = store.get_episode(eid)
        g = c.get(f"/api/episodes/{eid}").json()["graph"]
        assert not g["collapsed"]
        assert [n["id"] for n in g["nodes"]] == [a.id for a in ep.actions]
        assert [(n["agent"], n["step"], n["kind"]) for n in g["nodes"]] == [(a.agent, a.step, a.kind) for a in ep.actions]
        assert {(e["from"], e["to"]) for e in g["edges"]} == expected_edges(ep)
        assert len(g["edges"]) == len(expected_edges(ep))
        assert [lane["agent"] for lane in g["lanes"]] == ep.agents and g["steps"] == ep.steps()
        cells = {(n["lane"], n["col"], n["slot"]) for n in g["nodes"]}
        assert len(cells) == len(g["nodes"])  # no two nodes drawn on one spot
    captured = store.get_episode(ids["captured"])
    assert len(captured.actions) >= 3 and any(a.output.tool_calls for a in captured.actions)


def test_reward_credited_paths(ui):
    c, _, _ = ui
    d = c.get("/api/episodes/tool-episode-1").json()
    team, on_tool = d["credited"]
    # Team reward: the last step's final model call (write; not the env side step) and all it depends on.
    assert (team["value"], team["source"], set(team["actions"])) == (0.5, "checker", {"plan", "search-1", "write"})
    assert (on_tool["action_id"], set(on_tool["actions"])) == ("search-1", {"search-1", "plan"})
    assert d["task"] == {"question": "What are cats?"}


def test_action_detail_tool_call_tokens_policy_sampling(ui):
    c, _, _ = ui
    d = c.get("/api/episodes/tool-episode-1/actions/plan").json()
    rec = d["record"]
    assert rec["output"]["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"query": "cats"}'}
    assert d["tokens"] == [{"id": 5, "logprob": -0.05}, {"id": 17, "logprob": -1.2}, {"id": 3, "logprob": -7.5}]
    assert rec["token_source"] == "server" and rec["policy"] == {"name": "planner", "version": 2, "base_model": None}
    assert rec["sampling"]["temperature"] == 0.7 and rec["sampling"]["max_tokens"] == 64
    assert d["dependants"] == ["search-1", "write"] and d["index"] == 0
    assert {r["reward_id"] for r in d["rewards"]} == {r["reward_id"] for r in c.get(
        "/api/episodes/tool-episode-1").json()["credited"]}
    if "tools" in Observation.model_fields:
        assert rec["observation"]["tools"] == BOUND_TOOLS
    tool = c.get("/api/episodes/tool-episode-1/actions/search-1").json()
    assert tool["record"]["kind"] == "tool" and tool["tokens"] is None
    assert tool["record"]["observation"]["messages"][0]["tool_calls"][0]["id"] == "call_1"
    write = c.get("/api/episodes/tool-episode-1/actions/write").json()["record"]
    assert write["observation"]["messages"][2] == {"role": "tool", "content": "cats are mammals", "name": None,
                                                   "tool_calls": None, "tool_call_id": "call_1"}
    assert write["token_source"] == "retokenize"


def test_tokens_shown_as_text_with_a_tokenizer(store, tmp_path):
    from marft_bridge.demo.tinymodel import build_tokenizer
    from marft_bridge.ui.app import create_app

    tok = build_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    ids = tok.encode("cats\n", add_special_tokens=False) + [tok.eos_token_id]
    ep = Episode(id="tokens", actions=[Action(id="a", agent="planner", output={
        "text": "cats\n", "token_ids": ids, "logprobs": [-0.5] * len(ids)})])
    store.add_episode(ep)
    d = client_for(create_app(store, tokenizer=tmp_path / "tok")).get("/api/episodes/tokens/actions/a").json()
    assert [t["text"] for t in d["tokens"]] == ["c", "a", "t", "s", "\n", "<|im_end|>"]
    assert [t["id"] for t in d["tokens"]] == ids
    assert "text" not in client_for(create_app(store)).get("/api/episodes/tokens/actions/a").json()["tokens"][0]
    with pytest.raises(mb.MarftError, match="--tokenizer"):
        create_app(store, tokenizer=tmp_path / "nothing-here")


def test_action_list_paging_and_export(ui):
    c, ids, store = ui
    page = c.get("/api/episodes/tool-episode-1/actions", params={"limit": 2, "offset": 1}).json()
    assert page["total"] == 4 and [r["id"] for r in page["items"]] == ["search-1", "write"]
    assert page["items"][0]["label"] == "search" and page["items"][0]["depends_on"] == ["plan"]
    only = c.get("/api/episodes/tool-episode-1/actions", params={"agent": "planner", "step": 3}).json()
    assert [r["id"] for r in only["items"]] == ["side"]
    assert c.get("/api/episodes/tool-episode-1/actions", params={"limit": 501}).status_code == 400
    r = c.get(f"/api/episodes/{ids['captured']}/export")
    assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
    assert Episode.model_validate_json(r.content) == store.get_episode(ids["captured"])


def test_actions_are_named_by_their_index_in_the_episode(ui):
    """Time-ordered ids share their first digits: the page names actions #k, so the API gives indexes."""
    c, _, _ = ui
    page = c.get("/api/episodes/tool-episode-1/actions").json()
    assert [(r["index"], r["depends_on_index"]) for r in page["items"]] == [(0, []), (1, [0]), (2, [0, 1]), (3, [])]
    nodes = c.get("/api/episodes/tool-episode-1").json()["graph"]["nodes"]
    assert [n["depends_on_index"] for n in nodes] == [[], [0], [0, 1], []]
    assert c.get("/api/episodes/tool-episode-1/actions/search-1").json()["indexes"] == {"plan": 0, "write": 2}
    credited = c.get("/api/episodes/tool-episode-1").json()["credited"]
    assert [(r["action_id"], r["action_index"]) for r in credited] == [(None, None), ("search-1", 1)]


def test_an_unreadable_stored_episode_is_a_404_saying_so_and_a_count(store, store_url):
    from test_store_limits import spoil

    from marft_bridge.ui.app import create_app

    store.add_episode(tool_episode())
    store.add_episode(failed_episode())
    c = client_for(create_app(store))
    spoil(store_url, "tool-episode-1", "torn")  # after the index read it: opening it meets the bad row
    r = c.get("/api/episodes/tool-episode-1")
    assert r.status_code == 404 and "could not be read back" in r.json()["error"]
    assert c.get("/api/episodes").json()["unreadable"] == {"quarantined": 1, "skipped": 1}
    assert [d["record"] for d in c.get("/api/dead-letters").json()["items"]] == ["stored episode tool-episode-1"]


def test_live_changes_and_meta(ui):
    c, _, store = ui
    meta = c.get("/api/meta").json()
    assert meta["stats"]["episodes"] == 3 and meta["store"] == store.url
    cursor = meta["cursor"]
    assert c.get("/api/changes", params={"cursor": cursor}).json() == {"cursor": cursor, "episodes": []}
    store.add_episode(tool_episode("tool-episode-2", reward=0.9))
    store.add_reward("failed-episode", 0.1, source="user")
    import time

    time.sleep(0.6)  # the index re-reads the change log at most every 0.5 s
    ch = c.get("/api/changes", params={"cursor": cursor}).json()
    assert ch["cursor"] > cursor and {r["id"] for r in ch["episodes"]} == {"tool-episode-2", "failed-episode"}
    d = c.get("/api/episodes").json()
    assert d["total"] == 4
    assert next(r for r in d["items"] if r["id"] == "failed-episode")["reward"] == 0.1


def test_dead_letters(ui):
    c, _, store = ui
    bad = tool_episode("broken").model_dump(mode="json")
    bad["actions"][1]["depends_on"] = ["nowhere"]
    with pytest.raises(RecordError):
        store.add_episode(bad)
    (row,) = c.get("/api/dead-letters").json()["items"]
    assert row["field"] == "actions.1.depends_on" and "nowhere" in row["reason"]
    assert c.get("/api/dead-letters", params={"limit": 1000}).status_code == 400


def test_bad_ids_are_404(ui):
    c, _, _ = ui
    for path in ("/api/episodes/nope", "/api/episodes/nope/actions", "/api/episodes/nope/actions/x",
                 "/api/episodes/tool-episode-1/actions/nope", "/api/episodes/nope/export", "/api/runs/nope",
                 "/api/nothing", "/static/nothing.js"):
        r = c.get(path)
        assert r.status_code == 404 and "error" in r.json(), path


# -- runs and adapters -------------------------------------------------------------------------------


def test_a_metrics_line_too_deep_to_parse_is_one_unreadable_line(tmp_path):
    from marft_bridge.ui.files import read_jsonl_tail

    f = tmp_path / "metrics.jsonl"
    f.write_text('{"update": 1}\n' + "[" * 100_000 + "]" * 100_000 + '\n{"update": 2}\n')
    assert read_jsonl_tail(f, 10) == ([{"update": 1}, {"update": 2}], 1)


def test_a_metrics_tail_is_read_from_the_end(tmp_path):
    from marft_bridge.ui.files import read_jsonl_tail

    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(f'{{"update": {i}, "pad": "{"x" * 50}"}}\n' for i in range(5000)) + '{"update": 50')
    rows, bad = read_jsonl_tail(f, 3)
    assert [r["update"] for r in rows] == [4997, 4998, 4999] and bad == 1  # the torn last line
    # reading at most 2,000 bytes back: the rows inside them, the line cut at the start left out
    rows, bad = read_jsonl_tail(f, 100, max_bytes=2000)
    assert [r["update"] for r in rows] == list(range(4975, 5000)) and bad == 1


def test_runs_series_from_metrics_jsonl(ui):
    c, _, _ = ui
    (run,) = c.get("/api/runs").json()["runs"]
    assert (run["name"], run["updates"]) == ("runs/marft-a-s0", 3)
    d = c.get("/api/runs/runs/marft-a-s0").json()
    s = d["series"]
    assert d["unreadable_lines"] == 1  # the torn last line
    assert s["reward_mean"] == [[1, 0.25], [2, 0.5], [3, 0.75]]
    assert s["clipfrac"] == [[1, 0.0], [2, 0.1], [3, 0.2]] and s["factor_mean"][2] == [3, 0.95]
    assert s["skipped.no_reward"] == [[1, 2.0], [2, 0.0], [3, 1.0]] and "flagged.no_behaviour_logprobs" in s
    assert "agent_order" not in s and "update" not in s
    assert list(s)[:4] == ["reward_mean", "kl_ref", "entropy", "value_loss"]


@pytest.mark.parametrize("path", [
    "/api/runs/../../etc/passwd", "/api/runs/%2e%2e/%2e%2e/etc/passwd", "/api/runs/runs/..%2f..%2fsecret",
    "/api/episodes/..", "/static/..%2fapp.py", "/api/episodes?q=..", "/api/runs/%252e%252e/x",
])
def test_traversal_is_refused(ui, path):
    c, _, _ = ui
    r = c.get(path)
    assert r.status_code in (400, 404), path
    assert "root:" not in r.text


def test_read_only(ui):
    c, _, _ = ui
    for method in ("post", "put", "delete", "patch"):
        r = getattr(c, method)("/api/episodes")
        assert r.status_code == 405 and "read-only" in r.json()["error"]


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    from marft_bridge.serving.fixtures import make_random_adapter

    return make_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("ad") / "planner", seed=1, rank=4)


def test_adapters_versions_history_decisions_and_served_episodes(store, tmp_path, adapter_dir):
    from marft_bridge.serving.registry import AdapterRegistry
    from marft_bridge.ui.app import create_app

    reg = AdapterRegistry(tmp_path / "registry")
    for metric in (0.3, 0.6, 0.4):
        reg.publish("planner", adapter_dir, metrics={"train_reward": metric})
    reg.promote("planner", 1)
    reg.promote("planner", 2)
    reg.promote("planner", 3)
    reg.rollback("planner")  # back to 2
    AdapterRegistry(tmp_path / "outside").publish("evil", adapter_dir)
    (tmp_path / "registry" / "evil").symlink_to(tmp_path / "outside" / "evil")  # must not be read through
    state = tmp_path / "service"
    state.mkdir()
    rows = [{"time": "2026-05-01T12:00:00+00:00", "round": 1, "decision": "promote", "reason": "gate passed", "versions": {"planner": 3}},
            {"time": "2026-05-01T13:00:00+00:00", "round": 2, "decision": "rollback", "reason": "live reward fell", "versions": {"planner": 2}}]
    (state / "decisions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"time": "2026-05-01T14')
    store.add_episode(tool_episode("e1", reward=0.5, planner_version=2))
    store.add_episode(tool_episode("e2", reward=1.0, planner_version=2))
    store.add_episode(tool_episode("e3", reward=0.25, planner_version=3))
    c = client_for(create_app(store, registry=tmp_path / "registry", service_state=state))
    d = c.get("/api/adapters").json()
    (agent,) = d["agents"]
    assert any("evil" in p and "outside the registry" in p for p in d["problems"])
    assert (agent["agent"], agent["current"], agent["history"]) == ("planner", 2, [1, 2])
    by_v = {v["version"]: v for v in agent["versions"]}
    assert [by_v[v]["parent"] for v in (1, 2, 3)] == [None, None, None]
    assert by_v[2]["current"] and not by_v[3]["current"] and by_v[1]["metrics"] == {"train_reward": 0.3}
    assert by_v[2]["served"] == {"episodes": 2, "rewarded": 2, "mean_reward": 0.75}
    assert by_v[3]["served"] == {"episodes": 1, "rewarded": 1, "mean_reward": 0.25}
    assert by_v[1]["served"] is None
    assert [x["decision"] for x in d["decisions"]] == ["rollback", "promote"] and d["unreadable_decisions"] == 1
    assert d["served_elsewhere"] == {"writer:v1": {"episodes": 3, "rewarded": 3, "mean_reward": pytest.approx(1.75 / 3)}}


# -- a big episode -------------------------------------------------------------------------------------


def big_episode(n: int = 10_000) -> Episode:
    """A chain of n actions over four agents, 40 actions a step, every fifth a tool step."""
    agents = ["a", "b", "c", "d"]
    actions = [{"id": f"x{k}", "agent": agents[k % 4], "step": k // 40, "kind": "tool" if k % 5 == 0 else "llm",
                "depends_on": [f"x{k - 1}"] if k else []} for k in range(n)]
    return Episode(id="big", actions=actions, rewards=[Reward(value=1.0)], started_at=T0 - timedelta(days=1))


def test_ten_thousand_actions_graph_collapses_and_actions_page(tmp_path):
    from marft_bridge.store import TraceStore
    from marft_bridge.ui.app import create_app

    ep = big_episode()
    with TraceStore.open(tmp_path / "big.db") as store:
        store.add_episode(ep)
        c = client_for(create_app(store))
        g = c.get("/api/episodes/big").json()["graph"]
        groups = {(a.step, a.agent) for a in ep.actions}
        assert g["collapsed"] and len(g["nodes"]) == len(groups) == 250 * 4
        assert sum(n["count"] for n in g["nodes"]) == 10_000
        pairs = {(f"{ep.actions[k - 1].step}/{ep.actions[k - 1].agent}", f"{a.step}/{a.agent}") for k, a in enumerate(ep.actions) if k}
        assert {(e["from"], e["to"]) for e in g["edges"]} == pairs
        assert sum(e["count"] for e in g["edges"]) == 9_999
        page = c.get("/api/episodes/big/actions", params={"offset": 9_900, "limit": 500}).json()
        assert page["total"] == 10_000 and [r["index"] for r in page["items"]] == list(range(9_900, 10_000))
        step = c.get("/api/episodes/big/actions", params={"agent": "b", "step": 3}).json()
        assert [r["id"] for r in step["items"]] == [f"x{k}" for k in range(120, 160) if k % 4 == 1]
        last = c.get("/api/episodes/big/actions/x9999").json()
        assert [r["value"] for r in last["rewards"]] == [1.0] and "actions" not in last["rewards"][0]


# -- security ------------------------------------------------------------------------------------------


def test_api_key_required_on_every_request(store, tmp_path):
    from marft_bridge.ui.app import create_app

    store.add_episode(tool_episode())
    c = client_for(create_app(store, api_key="s3cret"), base_url="http://10.1.2.3:8080")
    for path in ("/", "/static/app.js", "/api/episodes", "/api/episodes/tool-episode-1", "/api/adapters"):
        assert c.get(path).status_code == 401, path
        assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200, path
    r = c.get("/?key=s3cret", follow_redirects=False)
    assert r.status_code == 303 and "?" not in r.headers["location"]
    assert c.get("/api/episodes").status_code == 200  # the cookie the redirect set
    assert c.get("/api/episodes/tool-episode-1/actions/plan").json()["record"]["id"] == "plan"


def test_without_key_only_loopback_hosts_are_answered(store):
    from marft_bridge.ui.app import create_app

    app = create_app(store)
    assert client_for(app, "http://127.0.0.1:8080").get("/api/episodes").status_code == 200
    assert client_for(app, "http://localhost:8080").get("/").status_code == 200
    r = client_for(app, "http://evil.example:8080").get("/api/episodes")  # DNS rebinding
    assert r.status_code == 403 and "loopback" in r.json()["error"]


def test_cli_refuses_non_loopback_without_key_and_missing_store(tmp_path, capsys):
    db = tmp_path / "t.db"
    mb.TraceStore.open(db).close()
    assert marft(["ui", "--store", str(db), "--host", "0.0.0.0"]) == 1
    assert "refusing to bind 0.0.0.0 without --api-key" in capsys.readouterr().err
    missing = tmp_path / "typo.db"
    assert marft(["ui", "--store", str(missing)]) == 1
    assert "no trace store at" in capsys.readouterr().err and not missing.exists()
    assert marft(["ui", "--store", str(db), "--runs", str(tmp_path / "none")]) == 1
    assert "--runs" in capsys.readouterr().err


def test_cli_help_lists_ui(capsys):
    with pytest.raises(SystemExit):
        marft(["ui", "--help"])
    out = capsys.readouterr().out
    assert "--api-key" in out and "--runs" in out and "127.0.0.1" in out
