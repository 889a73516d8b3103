"""LangGraph capture: real graphs with fake chat models; exact agents, steps and depends_on edges."""

from __future__ import annotations

import asyncio
import operator
import threading
from typing import Annotated, TypedDict

import pytest
from langchain_core.language_models.fake_chat_models import FakeListChatModel, GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Send

import marft_bridge as mb
from marft_bridge.capture import recording


def fake(*responses: str) -> FakeListChatModel:
    return FakeListChatModel(responses=list(responses) * 50)


def stored(store, app_or_id):
    store.flush()
    eid = app_or_id if isinstance(app_or_id, str) else app_or_id.last_episode_id
    return store.get_episode(eid)


def label(a) -> str:
    """agent@step, plus the last observed message for actions that share agent and step."""
    return f"{a.agent}@{a.step}"


def edges(ep, key=label) -> dict[str, tuple[str, list[str]]]:
    names = {a.id: key(a) for a in ep.actions}
    assert len(set(names.values())) == len(names), names
    return {names[a.id]: (a.kind, sorted(names[d] for d in a.depends_on)) for a in ep.actions}


# -- chain ---------------------------------------------------------------------------------------


class Doc(TypedDict, total=False):
    question: str
    plan: str
    code: str
    review: str


class CodeOnly(TypedDict):
    code: str


def chain_app():
    planner, coder, reviewer = fake("plan: add"), fake("def f(): return 4"), fake("looks right")

    def plan(s):
        return {"plan": planner.invoke([HumanMessage(s["question"])]).content}

    def code(s):
        return {"code": coder.invoke([HumanMessage(s["plan"])]).content}

    def review(s: CodeOnly):  # reads only the code channel
        return {"review": reviewer.invoke([HumanMessage(s["code"])]).content}

    g = StateGraph(Doc)
    g.add_node("planner", plan)
    g.add_node("coder", code)
    g.add_node("reviewer", review, input_schema=CodeOnly)
    g.add_edge(START, "planner")
    g.add_edge("planner", "coder")
    g.add_edge("coder", "reviewer")
    g.add_edge("reviewer", END)
    return g.compile()


def test_chain_exact_edges_and_unchanged_output(sqlite_store):
    plain = chain_app().invoke({"question": "2+2?"})
    app = mb.instrument(chain_app(), store=sqlite_store)
    out = app.invoke({"question": "2+2?"})
    assert out == plain
    ep = stored(sqlite_store, app)
    assert ep.source == "langgraph" and ep.task == {"question": "2+2?"} and ep.agents == ["planner", "coder", "reviewer"]
    assert edges(ep) == {
        "planner@1": ("llm", []),
        "coder@2": ("llm", ["planner@1"]),
        "reviewer@3": ("llm", ["coder@2"]),  # its input schema reads only `code`
    }
    planner = ep.actions[0]
    assert [m.model_dump(exclude_none=True) for m in planner.observation.messages] == [{"role": "user", "content": "2+2?"}]
    assert planner.output.text == "plan: add" and planner.token_source == "retokenize"
    assert planner.policy.name == "FakeListChatModel"
    assert planner.metadata["langgraph_node"] == "planner" and planner.metadata["langgraph_steps"] == [1]


# -- router / supervisor with a loop -------------------------------------------------------------


class Team(TypedDict, total=False):
    messages: Annotated[list, add_messages]
    next: str


def supervisor_app():
    boss = fake("researcher", "coder", "FINISH")
    researcher, coder = fake("found it"), fake("wrote it")

    def supervisor(s):
        return {"next": boss.invoke(s["messages"]).content}

    def research(s):
        return {"messages": [researcher.invoke(s["messages"])]}

    def code(s):
        return {"messages": [coder.invoke(s["messages"])]}

    g = StateGraph(Team)
    g.add_node("supervisor", supervisor)
    g.add_node("researcher", research)
    g.add_node("coder", code)
    g.add_edge(START, "supervisor")
    g.add_conditional_edges("supervisor", lambda s: END if s["next"] == "FINISH" else s["next"],
                            ["researcher", "coder", END])
    g.add_edge("researcher", "supervisor")
    g.add_edge("coder", "supervisor")
    return g.compile()


def test_supervisor_router_with_loop(sqlite_store):
    app = mb.instrument(supervisor_app(), store=sqlite_store)
    out = app.invoke({"messages": [HumanMessage("task")]})
    assert [m.content for m in out["messages"]] == ["task", "found it", "wrote it"] and out["next"] == "FINISH"
    ep = stored(sqlite_store, app)
    assert edges(ep) == {
        "supervisor@1": ("llm", []),
        "researcher@2": ("llm", ["supervisor@1"]),
        "supervisor@3": ("llm", ["researcher@2", "supervisor@1"]),  # `next` still holds supervisor@1's write
        "coder@4": ("llm", ["researcher@2", "supervisor@3"]),  # `next` was overwritten by supervisor@3
        "supervisor@5": ("llm", ["coder@4", "researcher@2", "supervisor@3"]),
    }
    agents, d = ep.dependency_matrix(4)
    assert agents == ["supervisor", "researcher", "coder"] and d == [[0, 0, 1], [0, 0, 1], [0, 0, 0]]
    # the second supervisor call saw the researcher's message
    assert [m.content for m in ep.actions[2].observation.messages] == ["task", "found it"]


# -- parallel fan-out / fan-in -------------------------------------------------------------------


class Fan(TypedDict, total=False):
    topic: str
    b_out: str
    c_out: str
    final: str


def fan_app():
    b_model, c_model, j_model = fake("b says"), fake("c says"), fake("joined")

    def split(s):  # no model call: an environment step
        return {"topic": s["topic"].upper()}

    def b(s):
        return {"b_out": b_model.invoke(s["topic"]).content}

    def c(s):
        return {"c_out": c_model.invoke(s["topic"]).content}

    def join(s):
        return {"final": j_model.invoke(s["b_out"] + s["c_out"]).content}

    g = StateGraph(Fan)
    for name, fn in (("split", split), ("b", b), ("c", c), ("join", join)):
        g.add_node(name, fn)
    g.add_edge(START, "split")
    g.add_edge("split", "b")
    g.add_edge("split", "c")
    g.add_edge(["b", "c"], "join")
    g.add_edge("join", END)
    return g.compile()


def test_parallel_fan_out_fan_in_with_env_step(sqlite_store):
    app = mb.instrument(fan_app(), store=sqlite_store)
    assert app.invoke({"topic": "x"}) == {"topic": "X", "b_out": "b says", "c_out": "c says", "final": "joined"}
    ep = stored(sqlite_store, app)
    assert edges(ep) == {
        "split@1": ("env", []),
        "b@2": ("llm", ["split@1"]),
        "c@2": ("llm", ["split@1"]),
        "join@3": ("llm", ["b@2", "c@2", "split@1"]),
    }
    split = next(a for a in ep.actions if a.kind == "env")
    assert split.output.text == '{"topic": "X"}' and split.token_source is None


class Sends(TypedDict, total=False):
    items: list
    item: str
    results: Annotated[list, operator.add]
    summary: str


def send_app():
    lead, summarizer = fake("p,q"), fake("summary")
    worker = GenericFakeChatModel(messages=iter([AIMessage("r")] * 100))

    def plan(s):
        return {"items": lead.invoke("split the work").content.split(",")}

    def work(s):
        return {"results": [worker.invoke(f"do {s['item']}").content + s["item"]]}

    def summarize(s):
        return {"summary": summarizer.invoke(" ".join(sorted(s["results"]))).content}

    g = StateGraph(Sends)
    g.add_node("lead", plan)
    g.add_node("worker", work)
    g.add_node("summarize", summarize)
    g.add_edge(START, "lead")
    g.add_conditional_edges("lead", lambda s: [Send("worker", {"item": i}) for i in s["items"]], ["worker"])
    g.add_edge("worker", "summarize")
    g.add_edge("summarize", END)
    return g.compile()


def test_send_api_fan_out(sqlite_store):
    app = mb.instrument(send_app(), store=sqlite_store)
    out = app.invoke({"items": []})
    assert sorted(out["results"]) == ["rp", "rq"] and out["summary"] == "summary"
    ep = stored(sqlite_store, app)

    def key(a):
        return f"{a.agent}:{a.observation.messages[0].content}"

    assert edges(ep, key) == {
        "lead:split the work": ("llm", []),
        "worker:do p": ("llm", ["lead:split the work"]),  # a Send task reads only its packet
        "worker:do q": ("llm", ["lead:split the work"]),
        "summarize:rp rq": ("llm", ["lead:split the work", "worker:do p", "worker:do q"]),
    }
    assert sorted(a.step for a in ep.actions) == [1, 2, 2, 3]


# -- subgraphs, several calls per node, agent_name ------------------------------------------------


class Outer(TypedDict, total=False):
    q: str
    plan: str
    draft: str
    final: str


class Inner(TypedDict, total=False):
    plan: str
    notes: str
    draft: str


def team_subgraph():
    """researcher -> writer on ``Inner``: the team a parent graph runs as a node."""
    researcher, writer = fake("notes"), fake("draft")
    sub = StateGraph(Inner)
    sub.add_node("researcher", lambda s: {"notes": researcher.invoke(s["plan"]).content})
    sub.add_node("writer", lambda s: {"draft": writer.invoke(s["plan"] + s["notes"]).content})
    sub.add_edge(START, "researcher")
    sub.add_edge("researcher", "writer")
    sub.add_edge("writer", END)
    return sub.compile()


def subgraph_app():
    planner, editor = fake("plan"), fake("final")
    g = StateGraph(Outer)
    g.add_node("planner", lambda s: {"plan": planner.invoke(s["q"]).content})
    g.add_node("team", team_subgraph())
    g.add_node("editor", lambda s: {"final": editor.invoke(s["draft"]).content})
    g.add_edge(START, "planner")
    g.add_edge("planner", "team")
    g.add_edge("team", "editor")
    g.add_edge("editor", END)
    return g.compile()


def test_subgraph_agents_named_by_path(sqlite_store):
    app = mb.instrument(subgraph_app(), store=sqlite_store)
    assert app.invoke({"q": "?"})["final"] == "final"
    ep = stored(sqlite_store, app)
    assert ep.agents == ["planner", "team/researcher", "team/writer", "editor"]
    assert edges(ep) == {
        "planner@1": ("llm", []),
        "team/researcher@2": ("llm", ["planner@1"]),
        "team/writer@2": ("llm", ["planner@1", "team/researcher@2"]),
        "editor@3": ("llm", ["planner@1", "team/researcher@2", "team/writer@2"]),
    }
    assert ep.actions[1].metadata["langgraph_steps"] == [2, 1] and ep.actions[2].metadata["langgraph_steps"] == [2, 2]


def test_several_calls_in_one_node_and_agent_name_metadata(sqlite_store):
    first, second, critic = fake("draft 1"), fake("draft 2"), fake("ok")

    class S(TypedDict, total=False):
        q: str
        answer: str
        verdict: str

    def think(s):
        d1 = first.invoke(s["q"]).content
        return {"answer": second.invoke(d1).content}

    g = StateGraph(S)
    g.add_node("think", think, metadata={"agent_name": "solver"})
    g.add_node("check", lambda s: {"verdict": critic.invoke(s["answer"]).content})
    g.add_edge(START, "think")
    g.add_edge("think", "check")
    g.add_edge("check", END)
    app = mb.instrument(g.compile(), store=sqlite_store)
    app.invoke({"q": "?"})
    ep = stored(sqlite_store, app)
    key = lambda a: f"{a.agent}:{a.output.text}"  # noqa: E731
    assert edges(ep, key) == {
        "solver:draft 1": ("llm", []),
        "solver:draft 2": ("llm", ["solver:draft 1"]),
        "check:ok": ("llm", ["solver:draft 1", "solver:draft 2"]),
    }
    assert {a.step for a in ep.actions if a.agent == "solver"} == {1}


# -- async, streaming, batch, threads ------------------------------------------------------------


def async_chain_app():
    planner, coder = fake("plan"), fake("code")

    async def plan(s):
        return {"plan": (await planner.ainvoke(s["question"])).content}

    async def code(s):
        return {"code": (await coder.ainvoke(s["plan"])).content}

    g = StateGraph(Doc)
    g.add_node("planner", plan)
    g.add_node("coder", code)
    g.add_edge(START, "planner")
    g.add_edge("planner", "coder")
    g.add_edge("coder", END)
    return g.compile()


def test_async_invoke_and_astream(sqlite_store):
    app = mb.instrument(async_chain_app(), store=sqlite_store)
    plain_chunks = asyncio.run(_collect(async_chain_app().astream({"question": "q"})))

    out = asyncio.run(app.ainvoke({"question": "q"}))
    assert out == {"question": "q", "plan": "plan", "code": "code"}
    first = app.last_episode_id
    assert edges(stored(sqlite_store, first)) == {"planner@1": ("llm", []), "coder@2": ("llm", ["planner@1"])}

    chunks = asyncio.run(_collect(app.astream({"question": "q"})))
    assert chunks == plain_chunks
    assert app.last_episode_id != first
    assert edges(stored(sqlite_store, app)) == {"planner@1": ("llm", []), "coder@2": ("llm", ["planner@1"])}


async def _collect(agen):
    return [c async for c in agen]


@pytest.mark.parametrize("how", ["break", "aclose", "cancel"])
def test_an_astream_the_app_leaves_early_closes_as_without_capture(sqlite_store, caplog, how):
    """``async for ... break`` inside ``asyncio.run`` (closed by the loop's shutdown), an explicit
    ``aclose()``, the consumer's task cancelled: the episode is complete, closed early, with the
    planner's call, and asyncio has no pending task to complain about (capture closes LangGraph's
    generator as the app's close would have)."""
    app = mb.instrument(async_chain_app(), store=sqlite_store)

    async def consume():
        agen = app.astream({"question": "q"})
        async for _ in agen:
            if how == "cancel":
                asyncio.current_task().cancel()
                await asyncio.sleep(0)
            break
        if how == "aclose":
            await agen.aclose()

    async def main():
        task = asyncio.ensure_future(consume())
        try:
            await task
        except asyncio.CancelledError:
            assert how == "cancel"

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(main())
    ep = stored(sqlite_store, app)
    assert (ep.status, ep.metadata.get("stream_closed_early")) == ("completed", True)
    assert [a.agent for a in ep.actions] == ["planner"]
    assert not [r for r in caplog.records if r.name == "asyncio"]


def test_stream_and_batch(sqlite_store):
    app = mb.instrument(chain_app(), store=sqlite_store)
    plain = list(chain_app().stream({"question": "q"}, stream_mode="updates"))
    assert list(app.stream({"question": "q"}, stream_mode="updates")) == plain
    assert edges(stored(sqlite_store, app))["reviewer@3"] == ("llm", ["coder@2"])

    before = sqlite_store.count()
    outs = app.batch([{"question": "a"}, {"question": "b"}, {"question": "c"}])
    assert [o["question"] for o in outs] == ["a", "b", "c"]
    sqlite_store.flush()
    assert sqlite_store.count() == before + 3
    tasks = sorted(e.task["question"] for e in sqlite_store.episodes() if e.task and e.task.get("question") in "abc")
    assert tasks == ["a", "b", "c"]


def test_eight_threads_eight_separate_episodes(sqlite_store):
    app = mb.instrument(chain_app(), store=sqlite_store)
    ids: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i):
        try:
            with mb.episode(store=sqlite_store, task={"i": i}) as ep:
                app.invoke({"question": f"q{i}"})
            ids[i] = ep.id
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(ids.values())) == 8
    for i, eid in ids.items():
        ep = stored(sqlite_store, eid)
        assert ep.task == {"i": i}
        assert edges(ep) == {"planner@1": ("llm", []), "coder@2": ("llm", ["planner@1"]),
                             "reviewer@3": ("llm", ["coder@2"])}
        assert ep.actions[0].observation.messages[0].content == f"q{i}"


def test_plain_threads_without_episode_each_get_their_own(sqlite_store):
    app = mb.instrument(chain_app(), store=sqlite_store)
    seen: list[tuple[str, str]] = []
    lock = threading.Lock()

    def run(i):
        app.invoke({"question": f"q{i}"})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sqlite_store.flush()
    eps = [e for e in sqlite_store.episodes() if e.source == "langgraph"]
    with lock:
        seen = sorted((e.task["question"], e.actions[0].observation.messages[0].content) for e in eps)
    assert seen == [(f"q{i}", f"q{i}") for i in range(8)]
    assert all(len(e.actions) == 3 for e in eps)


# -- episodes, rewards, capture() ----------------------------------------------------------------


def test_episode_groups_runs_and_rewards(sqlite_store):
    app = mb.instrument(chain_app(), store=sqlite_store,
                        reward_fn=lambda inp, out: float(out["review"] == "looks right"))
    with mb.episode(store=sqlite_store, task={"q": "two runs"}) as ep:
        app.invoke({"question": "first"})
        app.invoke({"question": "second"})
        ep.reward(0.5, agent="coder", source="judge")
    assert app.last_episode_id == ep.id
    got = stored(sqlite_store, ep.id)
    assert got.task == {"q": "two runs"}
    assert [(a.agent, a.step) for a in got.actions] == [
        ("planner", 1), ("coder", 2), ("reviewer", 3), ("planner", 4), ("coder", 5), ("reviewer", 6)]
    assert got.actions[4].depends_on == [got.actions[3].id]
    assert [(r.value, r.agent, r.source) for r in got.rewards] == [
        (1.0, None, "reward_fn"), (1.0, None, "reward_fn"), (0.5, "coder", "judge")]
    sqlite_store.add_reward(got.id, -1.0, source="user")
    assert stored(sqlite_store, got.id).rewards[-1].value == -1.0


def test_capture_context_records_apps_built_elsewhere(sqlite_store):
    app = chain_app()
    with mb.capture(store=sqlite_store) as cap:
        app.invoke({"question": "one"})
        app.invoke({"question": "two"})
    app.invoke({"question": "outside"})  # not captured
    assert len(cap.episode_ids) == 2
    for eid, q in zip(cap.episode_ids, ("one", "two")):
        ep = stored(sqlite_store, eid)
        assert ep.task == {"question": q}
        assert edges(ep)["reviewer@3"] == ("llm", ["coder@2"])
    sqlite_store.flush()
    assert sqlite_store.count() == 2


def test_capture_context_async(sqlite_store):
    async def main():
        async with mb.capture(store=sqlite_store) as cap:
            await async_chain_app().ainvoke({"question": "q"})
        return cap

    cap = asyncio.run(main())
    assert edges(stored(sqlite_store, cap.episode_ids[0])) == {
        "planner@1": ("llm", []), "coder@2": ("llm", ["planner@1"])}


def test_uninstrument_restores(sqlite_store):
    app = chain_app()
    original = app.invoke
    mb.instrument(app, store=sqlite_store)
    assert app.invoke != original
    mb.uninstrument(app)
    assert app.invoke == original and not hasattr(app, "last_episode_id")
    app.invoke({"question": "q"})
    sqlite_store.flush()
    assert sqlite_store.count() == 0


# -- capture failures never reach the app --------------------------------------------------------


def test_capture_failure_mid_run_leaves_output_unchanged(sqlite_store, monkeypatch):
    plain = supervisor_app().invoke({"messages": [HumanMessage("task")]})
    recording.reset_capture_stats()
    real = recording.EpisodeRecorder.record_action
    calls = {"n": 0}

    def flaky(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected capture failure")
        return real(self, *a, **kw)

    monkeypatch.setattr(recording.EpisodeRecorder, "record_action", flaky)
    app = mb.instrument(supervisor_app(), store=sqlite_store)
    out = app.invoke({"messages": [HumanMessage("task")]})
    assert [m.content for m in out["messages"]] == [m.content for m in plain["messages"]]
    assert out["next"] == plain["next"]
    stats = recording.capture_stats()
    assert stats["errors"] == 1 and stats["by_where"] == {"langgraph.llm_end": 1}
    ep = stored(sqlite_store, app)
    assert len(ep.actions) == 4 and ep.metadata["capture_errors"] == 1


def test_store_failure_and_reward_fn_failure_do_not_reach_the_app(sqlite_store, monkeypatch):
    recording.reset_capture_stats()

    def broken_submit(ep):
        raise OSError("disk full")

    monkeypatch.setattr(sqlite_store, "submit", broken_submit)
    monkeypatch.setattr(sqlite_store, "submit_record", broken_submit)  # what capture calls on a TraceStore
    app = mb.instrument(chain_app(), store=sqlite_store, reward_fn=lambda i, o: 1 / 0)
    out = app.invoke({"question": "q"})
    assert out["review"] == "looks right"
    assert recording.capture_stats()["by_where"] == {"langgraph.reward_fn": 1, "recording.submit": 1}


def test_app_errors_propagate_and_episode_is_failed(sqlite_store):
    class S(TypedDict, total=False):
        q: str
        a: str

    model = fake("fine")

    def ok(s):
        return {"a": model.invoke(s["q"]).content}

    def boom(s):
        raise ValueError("node failed")

    g = StateGraph(S)
    g.add_node("ok", ok)
    g.add_node("boom", boom)
    g.add_edge(START, "ok")
    g.add_edge("ok", "boom")
    app = mb.instrument(g.compile(), store=sqlite_store)
    with pytest.raises(ValueError, match="node failed"):
        app.invoke({"q": "?"})
    ep = stored(sqlite_store, app)
    assert ep.status == "failed" and "node failed" in ep.metadata["error"]
    assert [a.agent for a in ep.actions] == ["ok"]


# -- every chat-model call path ------------------------------------------------------------------


def test_streamed_and_tool_calling_calls_are_captured(sqlite_store):
    streamer = GenericFakeChatModel(messages=iter([AIMessage("streamed answer")] * 10))
    tooler = GenericFakeChatModel(messages=iter([AIMessage("", tool_calls=[
        {"name": "search", "args": {"q": "cats"}, "id": "call_2"}])] * 10))

    class S(TypedDict, total=False):
        q: str
        draft: str
        call: str

    def write(s):  # a node that streams its model's answer
        return {"draft": "".join(chunk.content for chunk in streamer.stream(s["q"]))}

    def act(s):
        return {"call": tooler.invoke(s["draft"]).tool_calls[0]["name"]}

    g = StateGraph(S)
    g.add_node("writer", write)
    g.add_node("actor", act)
    g.add_edge(START, "writer")
    g.add_edge("writer", "actor")
    app = mb.instrument(g.compile(), store=sqlite_store)
    out = app.invoke({"q": "cats?"})
    assert out["draft"] == "streamed answer" and out["call"] == "search"
    writer, actor = stored(sqlite_store, app).actions
    assert (writer.agent, writer.kind, writer.output.text) == ("writer", "llm", "streamed answer")
    assert actor.output.tool_calls == [
        {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"q": "cats"}'}}]
    assert actor.depends_on == [writer.id]


def test_with_structured_output_is_captured(sqlite_store):
    from pydantic import BaseModel

    class Plan(BaseModel):
        steps: list[str]

    class ToolModel(GenericFakeChatModel):
        def bind_tools(self, tools, **kwargs):
            return self

    model = ToolModel(messages=iter([AIMessage("", tool_calls=[
        {"name": "Plan", "args": {"steps": ["a", "b"]}, "id": "c1"}])] * 10))

    class S(TypedDict, total=False):
        q: str
        steps: list

    g = StateGraph(S)
    g.add_node("planner", lambda s: {"steps": model.with_structured_output(Plan).invoke(s["q"]).steps})
    g.add_edge(START, "planner")
    app = mb.instrument(g.compile(), store=sqlite_store)
    assert app.invoke({"q": "plan it"})["steps"] == ["a", "b"]
    (a,) = stored(sqlite_store, app).actions
    assert a.kind == "llm" and a.output.tool_calls[0]["function"]["name"] == "Plan"


def test_checkpointer_threads_and_config_marker_not_persisted(sqlite_store):
    from langgraph.checkpoint.memory import InMemorySaver

    saver = InMemorySaver()
    g = StateGraph(Team)
    replier = fake("hi there")
    g.add_node("agent", lambda s: {"messages": [replier.invoke(s["messages"])]})
    g.add_edge(START, "agent")
    app = mb.instrument(g.compile(checkpointer=saver), store=sqlite_store)
    cfg = {"configurable": {"thread_id": "t1"}}
    app.invoke({"messages": [HumanMessage("one")]}, cfg)
    first = app.last_episode_id
    out = app.invoke({"messages": [HumanMessage("two")]}, cfg)
    assert [m.content for m in out["messages"]] == ["one", "hi there", "two", "hi there"]
    assert app.last_episode_id != first
    second = stored(sqlite_store, app)
    assert [m.content for m in second.actions[0].observation.messages] == ["one", "hi there", "two"]
    for ckpt in saver.list(cfg):
        assert "__marft_capture" not in ckpt.config["configurable"]
        assert "__marft_capture" not in (ckpt.metadata or {})


def test_other_adapters_record_inside_a_node(sqlite_store):
    """What the MCP/A2A adapters do: find the node's episode and record a tool action as its agent."""
    from marft_bridge.integrations.langgraph import record_in_current_task

    planner = fake("look up cats")
    seen = {}

    class S(TypedDict, total=False):
        q: str
        plan: str
        facts: str

    def lookup(s):
        seen["episode"] = recording.current_episode()
        record_in_current_task({"observation": {"messages": [{"role": "tool", "content": s["plan"]}]},
                                "output": {"text": "cats are mammals"}}, kind="tool")
        return {"facts": "cats are mammals"}

    g = StateGraph(S)
    g.add_node("planner", lambda s: {"plan": planner.invoke(s["q"]).content})
    g.add_node("lookup", lookup)
    g.add_edge(START, "planner")
    g.add_edge("planner", "lookup")
    app = mb.instrument(g.compile(), store=sqlite_store)
    app.invoke({"q": "cats?"})
    ep = stored(sqlite_store, app)
    assert seen["episode"].id == ep.id
    assert edges(ep) == {"planner@1": ("llm", []), "lookup@2": ("tool", ["planner@1"])}  # no env action


def test_capture_inside_an_episode_joins_it(sqlite_store):
    with mb.episode(store=sqlite_store, task="both") as ep:
        with mb.capture(store=sqlite_store) as cap:
            chain_app().invoke({"question": "q"})
    assert cap.episode_ids == [ep.id]
    got = stored(sqlite_store, ep.id)
    assert got.task == "both" and [a.agent for a in got.actions] == ["planner", "coder", "reviewer"]


def test_functional_api_tasks_are_agents(sqlite_store):
    from langgraph.func import entrypoint, task

    idea_model, writer_model, critic_model = fake("idea"), fake("essay"), fake("fine")

    @task
    def brainstorm(topic: str) -> str:
        return idea_model.invoke(topic).content

    critique_started = threading.Event()

    @task
    def write(idea: str) -> str:
        critique_started.wait(10)  # so `write` cannot finish before `critique` is started
        return writer_model.invoke(idea).content

    @task
    def critique(idea: str) -> str:
        critique_started.set()
        return critic_model.invoke(idea).content

    @entrypoint()
    def workflow(topic: str) -> str:
        idea = brainstorm(topic).result()
        essay, note = write(idea), critique(idea)  # started together
        return essay.result() + " / " + note.result()

    app = mb.instrument(workflow, store=sqlite_store)
    assert app.invoke("cats") == "essay / fine"
    ep = stored(sqlite_store, app)
    assert edges(ep, key=lambda a: a.agent) == {
        "brainstorm": ("llm", []),
        "write": ("llm", ["brainstorm"]),
        "critique": ("llm", ["brainstorm"]),  # started before `write` finished: not its input
    }


def test_registry_is_passed_to_the_episodes_a_capture_opens(sqlite_store, tmp_path):
    seen = []
    model = fake("x")

    def node(s):
        seen.append(recording.current_episode().registry)
        return {"plan": model.invoke([HumanMessage(s["question"])]).content}

    g = StateGraph(Doc)
    g.add_node("planner", node)
    g.add_edge(START, "planner")
    a, b = tmp_path / "a", tmp_path / "b"
    app_a = mb.instrument(g.compile(), store=sqlite_store, registry=a)
    app_b = mb.instrument(g.compile(), store=sqlite_store, registry=b)
    app_plain = mb.instrument(g.compile(), store=sqlite_store)
    for app in (app_a, app_b, app_plain, app_a):
        app.invoke({"question": "q"})
    with mb.capture(store=sqlite_store, registry=b):
        g.compile().invoke({"question": "q"})
    assert seen == [a, b, None, a, b]  # per app, not a process-wide switch
    mb.uninstrument(app_a), mb.uninstrument(app_b), mb.uninstrument(app_plain)


class SendsWithContext(Sends, total=False):
    topic: str
    context: str


def test_a_send_packet_carries_the_channels_its_values_came_from(sqlite_store):
    """A worker sent ``{"item": i, "context": s["context"]}`` read the researcher's context (the very
    value its channel holds) as well as the lead's item: it depends on both (was: the lead only)."""
    researcher, lead, summarizer = fake("ctx"), fake("p,q"), fake("summary")
    worker = GenericFakeChatModel(messages=iter([AIMessage("r")] * 100))

    g = StateGraph(SendsWithContext)
    g.add_node("researcher", lambda s: {"context": researcher.invoke(f"research {s['topic']}").content})
    g.add_node("lead", lambda s: {"items": lead.invoke("split the work").content.split(",")})
    g.add_node("worker", lambda s: {"results": [worker.invoke(f"do {s['item']} with {s['context']}").content]})
    g.add_node("summarize", lambda s: {"summary": summarizer.invoke(" ".join(s["results"])).content})
    g.add_edge(START, "researcher")
    g.add_edge("researcher", "lead")
    g.add_conditional_edges("lead", lambda s: [Send("worker", {"item": i, "context": s["context"]})
                                               for i in s["items"]], ["worker"])
    g.add_edge("worker", "summarize")
    g.add_edge("summarize", END)
    app = mb.instrument(g.compile(), store=sqlite_store)
    app.invoke({"topic": "tides"})
    ep = stored(sqlite_store, app)

    def key(a):
        return f"{a.agent}:{a.observation.messages[0].content}"

    assert edges(ep, key) == {
        "researcher:research tides": ("llm", []),
        "lead:split the work": ("llm", ["researcher:research tides"]),  # its trigger
        "worker:do p with ctx": ("llm", ["lead:split the work", "researcher:research tides"]),
        "worker:do q with ctx": ("llm", ["lead:split the work", "researcher:research tides"]),
        # it reads the whole state (no input schema): every channel's writer
        "summarize:r r": ("llm", ["lead:split the work", "researcher:research tides", "worker:do p with ctx",
                                  "worker:do q with ctx"]),
    }
