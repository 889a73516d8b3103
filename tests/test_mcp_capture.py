"""MCP capture with a real in-process MCPServer and a real mcp.Client: tool steps, sampling,
error results, and the server half joined to the client's episode through ``_meta``."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import marft_bridge as mb
from marft_bridge.integrations import mcp as cap
from marft_bridge.integrations.crossprocess import propagation as prop
from marft_bridge.capture.recording import capture_stats, reset_capture_stats

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mcp_tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"mcp_tools_{name}", EXAMPLE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


server_mod = _load("server")
run_mod = _load("run")


def _by(ep, agent, kind):
    return [a for a in ep.actions if a.agent == agent and a.kind == kind]


def _run_agent(store, server, calls, answer="done"):
    async def go():
        from langchain_core.messages import HumanMessage
        from mcp import Client

        async with Client(server, sampling_callback=run_mod.sampler) as client:
            cap.instrument_client(client, agent="assistant")
            app = mb.instrument(run_mod.agent_graph(client, calls, answer), store=store)
            out = await app.ainvoke({"messages": [HumanMessage("why is the sky blue?")]})
            return app.last_episode_id, out

    eid, out = asyncio.run(go())
    store.flush()
    assert prop.flush_joins(store, timeout=60)
    return store.get_episode(eid), out


def assert_tool_episode(ep):
    """The exact graph of the example run (add, then summarize with sampling, then the answer)."""
    # The node calling MCP ("tools") runs the assistant's tool calls: the steps are the assistant's.
    assert ep.agents == ["assistant", "calc"]
    llm1, sampled, llm2 = _by(ep, "assistant", "llm")
    add, summ = _by(ep, "assistant", "tool")
    srv_add, srv_summ = _by(ep, "calc", "tool")
    assert llm1.depends_on == []
    # The tool step depends on the model call that asked for it ...
    assert add.depends_on == [llm1.id]
    assert (add.output.text, add.error) == ("5", None)
    assert add.metadata["mcp.tool"] == "add" and add.metadata["mcp.arguments"] == {"a": 2, "b": 3}
    assert add.observation.messages[0].tool_calls[0]["function"]["name"] == "add"
    # ... the sampling call the server made during `summarize` is the client agent's model call ...
    assert sampled.metadata["mcp.sampling"] is True
    assert [(m.role, m.content) for m in sampled.observation.messages] == [
        ("system", "You summarize."), ("user", "Summarize: why is the sky blue?")]
    assert sampled.output.text == "why is the sky blue?" and sampled.policy.name == "assistant"
    assert (sampled.sampling.temperature, sampled.sampling.max_tokens) == (0.0, 32)
    # Each tool call depends on the model call that asked for it (not on the other tool's result).
    assert sampled.depends_on == [llm1.id]
    assert summ.depends_on == [llm1.id, sampled.id]
    assert summ.output.text == "summary: why is the sky blue?"
    # ... the server's half joins on the client's tool steps ...
    assert srv_add.depends_on == [add.id] and srv_add.step == add.step + 1 and srv_add.output.text == "5"
    assert srv_summ.depends_on == [summ.id] and srv_summ.output.text == "summary: why is the sky blue?"
    # ... and the agent's next model call depends on the tool results.
    assert llm2.depends_on == [llm1.id, add.id, summ.id]
    assert llm2.output.text == "2 + 3 = 5"
    assert ep.status == "completed" and ep.source != "mcp"


def test_agent_tool_steps_sampling_and_server_half(sqlite_store):
    reset_capture_stats()
    server = cap.instrument_server(server_mod.build_server(), store=sqlite_store)
    calls = [{"name": "add", "args": {"a": 2, "b": 3}, "id": "c1"},
             {"name": "summarize", "args": {"text": "why is the sky blue?"}, "id": "c2"}]
    ep, _ = _run_agent(sqlite_store, server, calls, "2 + 3 = 5")
    assert_tool_episode(ep)
    assert capture_stats()["errors"] == 0
    assert sqlite_store.count() == 1
    # Client and server live in one process: the server's half went straight into the client's
    # recorder (one write, no join writer).
    assert prop.join_writer(sqlite_store).written == 0


def test_error_results_are_failed_steps_and_reach_the_caller_unchanged(sqlite_store):
    server = server_mod.build_server()
    calls = [{"name": "divide", "args": {"a": 1, "b": 0}, "id": "c1"},
             {"name": "no_such_tool", "args": {}, "id": "c2"}]

    async def plain():
        from mcp import Client

        async with Client(server) as client:
            return [await client.call_tool(c["name"], c["args"]) for c in calls]

    expected = asyncio.run(plain())  # what an uncaptured client gets
    cap.instrument_server(server, store=sqlite_store)
    ep, out = _run_agent(sqlite_store, server, calls)
    got = [m.content for m in out["messages"] if m.type == "tool"]
    assert got == [cap.result_text(r)[0] for r in expected]
    assert all(r.is_error for r in expected)
    div, missing = _by(ep, "assistant", "tool")
    srv_div, srv_missing = _by(ep, "calc", "tool")
    assert div.error == expected[0].content[0].text and div.output.text == div.error
    assert missing.error == expected[1].content[0].text
    assert srv_div.depends_on == [div.id] and srv_div.error == div.error
    assert srv_missing.depends_on == [missing.id] and srv_missing.error == missing.error


def test_outside_an_episode_nothing_is_recorded_or_sent(sqlite_store):
    server = server_mod.build_server()
    seen = []

    async def spy(ctx, call_next):
        seen.append(dict(ctx.meta or {}))
        return await call_next(ctx)

    cap.instrument_server(server, store=sqlite_store)
    server.middleware.insert(0, spy)

    async def go():
        from mcp import Client

        async with Client(server) as client:
            cap.instrument_client(client, agent="assistant")
            return await client.call_tool("add", {"a": 1, "b": 1})

    assert cap.result_text(asyncio.run(go())) == ("2", False)
    assert prop.flush_joins(sqlite_store, timeout=30)
    assert sqlite_store.count() == 0
    tools_call = [m for m in seen if m is not None]
    assert all(prop.CALLER_KEY not in m and "traceparent" not in m for m in tools_call)


def test_uninstrument_restores_the_client(sqlite_store):
    server = server_mod.build_server()

    async def go():
        from mcp import Client

        async with Client(server, sampling_callback=run_mod.sampler) as client:
            cap.instrument_client(client)
            cap.uninstrument_client(client)
            assert "call_tool" not in vars(client) and client.sampling_callback is run_mod.sampler
            with mb.episode(store=sqlite_store) as ep:
                await client.call_tool("add", {"a": 1, "b": 2})
            return ep.id

    eid = asyncio.run(go())
    sqlite_store.flush()
    assert sqlite_store.get_episode(eid).actions == []


def test_a_result_over_the_record_limit_loses_that_step_only(sqlite_store):
    """Tool actions are validated on the call path only when app texts could break the record
    limits: an oversized result drops the tool steps (a counted capture error), not the episode."""
    from mcp.server.mcpserver import MCPServer

    from marft_bridge.schema import MAX_TEXT_CHARS

    server = MCPServer("big")

    @server.tool()
    def big(n: int) -> str:
        """A long text."""
        return "x" * n

    cap.instrument_server(server, store=sqlite_store)
    reset_capture_stats()

    async def go():
        from mcp import Client

        async with Client(server) as client:
            cap.instrument_client(client, agent="assistant")
            with mb.episode(store=sqlite_store) as ep:
                ep.record_action("assistant", output={"text": "ask"})
                small = await client.call_tool("big", {"n": 3})
                huge = await client.call_tool("big", {"n": MAX_TEXT_CHARS + 1})
            return ep.id, small, huge

    eid, small, huge = asyncio.run(go())
    assert cap.result_text(huge)[0] == "x" * (MAX_TEXT_CHARS + 1)  # the app still gets its result
    sqlite_store.flush()
    prop.flush_joins(sqlite_store, timeout=60)
    ep = sqlite_store.get_episode(eid)
    assert [(a.agent, a.kind, a.output.text) for a in ep.actions] == [
        ("assistant", "llm", "ask"), ("assistant", "tool", "xxx"), ("big", "tool", "xxx")]
    assert capture_stats()["errors"] == 2  # the client's and the server's record of the huge result
    assert sqlite_store.stats()["dead_letters"] == 0


def test_a_sampling_callback_calling_a_model_is_one_action(sqlite_store, monkeypatch):
    """The client's sampling callback answers the server with a real ``openai`` call: one ``llm``
    action of the asking agent (``mcp.sampling``) holding that call's exact output and model, not a
    second action of its own."""
    from langchain_core.messages import HumanMessage
    from mcp import Client
    from mcp_types import CreateMessageResult, TextContent
    from openai import AsyncOpenAI

    from fake_responses import FakeServer

    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    reset_capture_stats()
    server = cap.instrument_server(server_mod.build_server(), store=sqlite_store)
    calls = [{"name": "summarize", "args": {"text": "why is the sky blue?"}, "id": "c2"}]
    with FakeServer() as srv:
        model = AsyncOpenAI(base_url=srv.url, api_key="test", max_retries=0)

        async def sampler(context, params):
            reply = await model.chat.completions.create(
                model="sampler-model", messages=[{"role": "user", "content": params.messages[-1].content.text}])
            return CreateMessageResult(role="assistant", model="sampler-model",
                                       content=TextContent(type="text", text=reply.choices[0].message.content))

        async def go():
            async with Client(server, sampling_callback=sampler) as client:
                cap.instrument_client(client, agent="assistant")
                app = mb.instrument(run_mod.agent_graph(client, calls, "done"), store=sqlite_store)
                await app.ainvoke({"messages": [HumanMessage("why is the sky blue?")]})
                return app.last_episode_id

        eid = asyncio.run(go())
    sqlite_store.flush()
    assert prop.flush_joins(sqlite_store, timeout=60)
    ep = sqlite_store.get_episode(eid)
    llm = [a for a in ep.actions if a.kind == "llm"]
    sampled = [a for a in llm if a.metadata.get("mcp.sampling")]
    assert len(sampled) == 1 and not [a for a in llm if a.agent == "sampler-model"]
    (s,) = sampled
    assert s.policy.name == "sampler-model" and s.output.text.startswith("helper says ")
    assert s.metadata["response_id"] == "chatcmpl-1"  # read off the model call's own response
    asked = next(a for a in llm if a.output.tool_calls)
    assert asked.id in s.depends_on
    assert capture_stats()["errors"] == 0
