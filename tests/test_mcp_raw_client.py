"""An MCP server's tools run by hand from a raw ``openai`` client's function-calling loop: each MCP
call is the tool step of the model call that asked for it (matched by tool name and arguments among
the episode's recorded tool calls), answering its tool_call_id, whichever agent spoke last."""

from __future__ import annotations

import asyncio
import json

import mcp_apps
from fake_responses import FakeServer
from openai import AsyncOpenAI

import marft_bridge as mb
from marft_bridge.integrations import mcp as cap
from marft_bridge.integrations.crossprocess import propagation as prop
from marft_bridge.capture.recording import capture_stats, reset_capture_stats


def test_each_mcp_call_is_the_step_of_the_model_call_that_asked_for_it(sqlite_store, monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    reset_capture_stats()
    server = cap.instrument_server(mcp_apps.build_server(), store=sqlite_store)

    async def main(url):
        client = AsyncOpenAI(base_url=url, api_key="test", max_retries=0)
        async with mcp_apps.session(server) as session:
            cap.instrument_client(session)  # no agent given: the asking call names it
            with mb.episode(store=sqlite_store) as ep:
                # both agents ask first; the app then runs both calls (the solver spoke last)
                asked = {who: await client.responses.create(model=f"{who}-mcp", input=f"{who}, please")
                         for who in ("planner", "solver")}
                for who, r in asked.items():
                    fc = r.output[0]
                    out = await session.call_tool(fc.name, json.loads(fc.arguments))
                    result = cap.result_text(out)[0]
                    await client.responses.create(model=f"{who}-mcp", input=[
                        {"role": "user", "content": f"{who}, please"},
                        {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
                        {"type": "function_call_output", "call_id": fc.call_id, "output": result}])
            return ep

    with FakeServer() as srv:
        ep = asyncio.run(main(srv.url))
    sqlite_store.flush()
    assert prop.flush_joins(sqlite_store, timeout=60)
    ep = sqlite_store.get_episode(ep.id)
    by = {(a.agent, a.kind, a.metadata.get("mcp.tool")): a for a in ep.actions if a.agent != "calc"}
    plan_ask, solve_ask = (a for a in ep.actions if a.kind == "llm" and not a.depends_on)
    add, mul = by[("planner-mcp", "tool", "add")], by[("solver-mcp", "tool", "multiply")]
    assert (add.depends_on, add.metadata["tool_call_id"], add.output.text) == ([plan_ask.id], "call_add", "5")
    assert (mul.depends_on, mul.metadata["tool_call_id"], mul.output.text) == ([solve_ask.id], "call_mul", "20")
    assert add.observation.messages[0].tool_calls[0]["id"] == "call_add"
    plan_answer = next(a for a in ep.actions if a.output.text == "planner-mcp result=5")
    assert add.id in plan_answer.depends_on and mul.id not in plan_answer.depends_on
    assert capture_stats()["errors"] == 0


def test_a_model_call_a_served_tool_makes_is_the_servers_agent_in_its_half(sqlite_store, monkeypatch):
    """A served tool answering with its own ``openai`` call: that call is an action of the server's
    half named ``"<server>/<model>"`` (as an A2A agent's are), between the caller's tool step and
    the server's own step."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    reset_capture_stats()

    async def main(url):
        client = AsyncOpenAI(base_url=url, api_key="test", max_retries=0)
        served = mcp_apps.build_server("experts")

        @served.tool()
        async def ask_expert(question: str) -> str:
            """Ask the expert model."""
            r = await client.chat.completions.create(model="expert-model", messages=[{"role": "user", "content": question}])
            return r.choices[0].message.content

        server = cap.instrument_server(served, store=sqlite_store)
        async with mcp_apps.session(server) as session:
            cap.instrument_client(session, agent="lead")
            with mb.episode(store=sqlite_store) as ep:
                out = await session.call_tool("ask_expert", {"question": "why blue?"})
            return ep, cap.result_text(out)[0]

    with FakeServer() as srv:
        ep, answer = asyncio.run(main(srv.url))
    assert answer == "helper says why blue?"
    sqlite_store.flush()
    assert prop.flush_joins(sqlite_store, timeout=60)
    got = sqlite_store.get_episode(ep.id)
    asked, model, served_step = got.actions
    assert [(a.agent, a.kind) for a in got.actions] == [("lead", "tool"), ("experts/expert-model", "llm"),
                                                        ("experts", "tool")]
    assert (model.depends_on, served_step.depends_on) == ([asked.id], [model.id])
    assert capture_stats()["errors"] == 0
