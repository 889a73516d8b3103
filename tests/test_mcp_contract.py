"""The MCP capture contract on both ends of the supported range (CI runs this file on the pinned
mcp 2.x and again on the lowest 1.x, beside langchain-mcp-adapters: ``.ci/run`` step 3). A real
MCP server and client session in one process; MCP tools inside a real ReAct agent: one tool step
per tool execution, the asking agent's, with the MCP details and the server's half joined to it."""

from __future__ import annotations

import asyncio
import importlib.util

import mcp_apps
import pytest
import tool_apps as ta
from langchain_core.messages import AIMessage

import marft_bridge as mb
from marft_bridge.integrations import mcp as cap
from marft_bridge.integrations.crossprocess import propagation as prop
from marft_bridge.capture.messages import content_text
from marft_bridge.capture.recording import capture_stats, reset_capture_stats

HAS_ADAPTERS = importlib.util.find_spec("langchain_mcp_adapters") is not None


@pytest.fixture(autouse=True)
def _clean():
    reset_capture_stats()
    yield
    cap.uninstrument()


def _asks_both(messages):
    if not ta.tool_results(messages):
        return AIMessage("", tool_calls=[ta.call("add", {"a": 2, "b": 3}, messages, 0),
                                         ta.call("multiply", {"a": 4, "b": 5}, messages, 1)])
    return AIMessage("results: " + ", ".join(content_text(m.content) for m in ta.tool_results(messages)))


def _names(ep) -> dict[str, str]:
    seen: dict[str, int] = {}
    out = {}
    for a in ep.actions:
        base = f"{a.agent}:{a.kind}" + (f":{a.metadata['mcp.tool']}" if a.kind == "tool" else "")
        out[a.id] = f"{base}#{seen.get(base, 0)}"
        seen[base] = seen.get(base, 0) + 1
    return out


def graph(ep) -> dict[str, list[str]]:
    names = _names(ep)
    return {names[a.id]: sorted(names[d] for d in a.depends_on) for a in ep.actions}


REACT = {
    "agent:llm#0": [],
    "agent:tool:add#0": ["agent:llm#0"],
    "agent:tool:multiply#0": ["agent:llm#0"],
    # the server's half, joined to the client's tool steps
    "calc:tool:add#0": ["agent:tool:add#0"],
    "calc:tool:multiply#0": ["agent:tool:multiply#0"],
    "agent:llm#1": ["agent:llm#0", "agent:tool:add#0", "agent:tool:multiply#0"],
}


def run_react(sqlite_store, tools_of, per_session: bool = True):
    """A ReAct agent over the MCP server's tools (``tools_of(session)``) asking for two at once."""
    server = cap.instrument_server(mcp_apps.build_server(), store=sqlite_store)

    async def go():
        async with mcp_apps.session(server) as session:
            if per_session:
                cap.instrument_client(session)
            tools = await tools_of(session)
            app = mb.instrument(ta.create_react_agent(ta.ToolCallingModel(policy=_asks_both), tools),
                                store=sqlite_store)
            out = await app.ainvoke(ta.ask())
            return app.last_episode_id, out

    eid, out = asyncio.run(go())
    assert out["messages"][-1].content == "results: 5, 20"
    sqlite_store.flush()
    assert prop.flush_joins(sqlite_store, timeout=60)
    return sqlite_store.get_episode(eid)


def check_react(ep):
    assert graph(ep) == REACT
    steps = {a.metadata["mcp.tool"]: a for a in ep.actions if a.kind == "tool" and a.agent == "agent"}
    add, mul = steps["add"], steps["multiply"]
    # one step per execution: the LangChain tool step, with the MCP details
    assert (add.output.text, mul.output.text) == ("5", "20")
    assert add.metadata["tool.name"] == "add" and add.metadata["tool_call_id"] == ep.actions[0].output.tool_calls[0]["id"]
    assert add.metadata["mcp.arguments"] == {"a": 2, "b": 3} and add.metadata["mcp.server"] == "calc"
    assert add.metadata["mcp.session"] and add.metadata["mcp.session"] == mul.metadata["mcp.session"]
    assert ep.agents == ["agent", "calc"]
    assert capture_stats()["errors"] == 0


async def _hand_made_tools(session):
    return [mcp_apps.mcp_tool(session, "add", "Add two integers."),
            mcp_apps.mcp_tool(session, "multiply", "Multiply two integers.")]


def test_mcp_tools_inside_a_react_agent_are_one_step_each(sqlite_store):
    check_react(run_react(sqlite_store, _hand_made_tools))


def test_sessions_the_app_never_hands_out_are_captured_by_instrument(sqlite_store):
    """``mcp.instrument()`` hooks every ``ClientSession`` (what a client that opens a session per
    tool call needs); no per-session call."""
    assert cap.instrument()
    check_react(run_react(sqlite_store, _hand_made_tools, per_session=False))


@pytest.mark.skipif(not HAS_ADAPTERS, reason="langchain-mcp-adapters needs mcp<2 (CI runs this on the lowest mcp)")
def test_langchain_mcp_adapters_tools_inside_a_react_agent(sqlite_store):
    from langchain_mcp_adapters.tools import load_mcp_tools

    async def adapters(session):
        tools = await load_mcp_tools(session)
        return [t for t in tools if t.name in ("add", "multiply")]

    check_react(run_react(sqlite_store, adapters))


def test_a_call_outside_langgraph_is_the_given_agents_step(sqlite_store):
    server = cap.instrument_server(mcp_apps.build_server(), store=sqlite_store)

    async def go():
        async with mcp_apps.session(server) as session:
            cap.instrument_client(session, agent="assistant")
            with mb.episode(store=sqlite_store) as ep:
                ep.record_action("assistant", output={"text": "let me divide"})
                ok = await session.call_tool("divide", {"a": 1, "b": 4})
                bad = await session.call_tool("divide", {"a": 1, "b": 0})
            return ep.id, ok, bad

    eid, ok, bad = asyncio.run(go())
    assert cap.result_text(ok) == ("0.25", False) and cap.result_text(bad)[1] is True
    sqlite_store.flush()
    assert prop.flush_joins(sqlite_store, timeout=60)
    ep = sqlite_store.get_episode(eid)
    ask, div_ok, srv_ok, div_bad, srv_bad = ep.actions
    assert [(a.agent, a.kind) for a in ep.actions] == [("assistant", "llm"), ("assistant", "tool"), ("calc", "tool"),
                                                       ("assistant", "tool"), ("calc", "tool")]
    assert div_ok.depends_on == [ask.id] and div_bad.depends_on == [ask.id]
    assert srv_ok.depends_on == [div_ok.id] and srv_bad.depends_on == [div_bad.id]
    assert div_ok.error is None and div_bad.error == cap.result_text(bad)[0] and srv_bad.error == div_bad.error
    assert capture_stats()["errors"] == 0


def test_outside_an_episode_nothing_is_recorded_and_uninstrument_restores(sqlite_store):
    from mcp.client.session import ClientSession

    original = vars(ClientSession)["call_tool"]
    server = cap.instrument_server(mcp_apps.build_server(), store=sqlite_store)
    assert cap.instrument() and vars(ClientSession)["call_tool"] is not original
    cap.instrument()  # idempotent

    async def go():
        async with mcp_apps.session(server) as session:
            cap.instrument_client(session)
            out = await session.call_tool("add", {"a": 1, "b": 1})
            cap.uninstrument_client(session)
            assert "call_tool" not in vars(session)
            return out

    assert cap.result_text(asyncio.run(go())) == ("2", False)
    cap.uninstrument()
    assert vars(ClientSession)["call_tool"] is original
    cap.uninstrument_server(server)
    assert prop.flush_joins(sqlite_store, timeout=30)
    sqlite_store.flush()
    assert sqlite_store.count() == 0
