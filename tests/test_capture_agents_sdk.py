"""OpenAI Agents SDK apps captured by ``mb.capture()``: two real SDK agents (a triage agent with a
function tool and a handoff to a billing agent) on the SDK's default Responses-API model with the
real ``openai`` client, against a scripted local server. Exact agents, kinds, tool steps and D."""

from __future__ import annotations

import asyncio
import json

import pytest
from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_trace_processors
from openai import AsyncOpenAI

import marft_bridge as mb
from marft_bridge.integrations import openai_agents
from marft_bridge.integrations.openai_agents import runs as openai_agents_runs
from marft_bridge.capture.recording import capture_stats, reset_capture_stats
from fake_responses import FakeServer


@pytest.fixture(scope="module")
def srv():
    with FakeServer() as s:
        yield s


@pytest.fixture(autouse=True)
def _only_our_processor(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    set_trace_processors([openai_agents.trace_processor()])  # no export to the OpenAI backend
    reset_capture_stats()


def team(url: str, model_class=OpenAIResponsesModel):
    client = AsyncOpenAI(base_url=url, api_key="test", max_retries=0)

    @function_tool
    def lookup(city: str) -> str:
        """The weather in a city."""
        return f"{city}: 21C"

    billing = Agent(name="billing", instructions="You bill.", model=model_class("billing-model", client))
    triage = Agent(name="triage", instructions="You route.", tools=[lookup], handoffs=[billing],
                   model=model_class("triage-model", client))
    return triage


def check_episode(ep):
    acts = ep.actions
    assert [(a.agent, a.kind) for a in acts] == [
        ("triage", "llm"), ("triage", "tool"), ("triage", "llm"), ("triage", "tool"), ("billing", "llm")]
    plan, lookup, route, handoff, bill = acts
    assert [sorted(a.depends_on) for a in acts[:4]] == [[], [plan.id], sorted([plan.id, lookup.id]), [route.id]]
    # route read plan's tool call and its result; billing saw plan's and route's tool calls, the
    # lookup result (call_lookup), route's text and the handoff's result (call_handoff)
    assert sorted(bill.depends_on) == sorted([plan.id, lookup.id, route.id, handoff.id])
    assert [a.policy.name for a in (plan, route, bill)] == ["triage-model", "triage-model", "billing-model"]
    # what the model saw: instructions as the system message, the tools in chat shape
    assert plan.observation.messages[0].model_dump(exclude_none=True) == {"role": "system", "content": "You route."}
    assert plan.observation.messages[1].content == "weather in Paris, then bill me"
    assert [t["function"]["name"] for t in plan.observation.tools] == ["lookup", "transfer_to_billing"]
    assert plan.observation.tools[0]["function"]["parameters"]["properties"] == {"city": {"title": "City", "type": "string"}}
    assert plan.output.tool_calls == [{"id": "call_lookup", "type": "function",
                                       "function": {"name": "lookup", "arguments": '{"city": "Paris"}'}}]
    assert plan.output.finish_reason == "tool_calls" and plan.output.text == ""
    # the function tool step, shaped like MCP / LangChain tool steps
    assert lookup.output.text == "Paris: 21C" and lookup.error is None
    assert lookup.observation.messages[0].tool_calls == plan.output.tool_calls
    assert {k: lookup.metadata[k] for k in ("tool.name", "tool.arguments", "tool_call_id")} == {
        "tool.name": "lookup", "tool.arguments": {"city": "Paris"}, "tool_call_id": "call_lookup"}
    # the route call saw the tool result as a tool message answering call_lookup
    tool_msg = route.observation.messages[-1]
    assert (tool_msg.role, tool_msg.tool_call_id, tool_msg.content) == ("tool", "call_lookup", "Paris: 21C")
    assert route.output.text == "Handing over." and route.output.tool_calls[0]["function"]["name"] == "transfer_to_billing"
    # the handoff is the transfer_to_billing tool step, its result the SDK's transfer message
    assert handoff.metadata["tool.name"] == "transfer_to_billing" and handoff.metadata["handoff.goto"] == "billing"
    assert handoff.metadata["tool_call_id"] == "call_handoff" and json.loads(handoff.output.text) == {"assistant": "billing"}
    assert bill.observation.messages[0].content == "You bill." and bill.output.text == "billed: Paris: 21C"
    assert ep.source == "openai_agents" and ep.task == "weather in Paris, then bill me"
    assert ep.metadata["trace_id"].startswith("trace_")


def test_runner_run_is_one_episode_with_tool_steps_and_a_handoff(srv, sqlite_store):
    with mb.capture(store=sqlite_store) as cap:
        result = Runner.run_sync(team(srv.url), "weather in Paris, then bill me")
    assert result.final_output == "billed: Paris: 21C"
    assert len(cap.episode_ids) == 1
    sqlite_store.flush()
    check_episode(sqlite_store.get_episode(cap.episode_ids[0]))
    assert capture_stats()["errors"] == 0


def test_async_runs_each_open_their_own_episode(srv, sqlite_store):
    async def main():
        async with mb.capture(store=sqlite_store) as cap:
            await Runner.run(team(srv.url), "weather in Paris, then bill me")
            await Runner.run(team(srv.url), "weather in Paris, then bill me")
        return cap

    cap = asyncio.run(main())
    assert len(cap.episode_ids) == 2 and cap.episode_ids[0] != cap.episode_ids[1]
    sqlite_store.flush()
    for eid in cap.episode_ids:
        check_episode(sqlite_store.get_episode(eid))


def test_a_run_inside_an_episode_joins_it(srv, sqlite_store):
    with mb.episode(store=sqlite_store) as ep:
        Runner.run_sync(team(srv.url), "weather in Paris, then bill me")
    sqlite_store.flush()
    assert [(a.agent, a.kind) for a in sqlite_store.get_episode(ep.id).actions][-1] == ("billing", "llm")
    assert sqlite_store.count() == 1


def test_runs_outside_capture_record_nothing(srv, sqlite_store):
    Runner.run_sync(team(srv.url), "weather in Paris, then bill me")
    with mb.capture(store=sqlite_store):
        pass
    sqlite_store.flush()
    assert sqlite_store.count() == 0


def streamed(agent, text: str, store):
    """``Runner.run_streamed`` inside ``mb.capture``, every event read: (the capture block, the run)."""
    async def main():
        with mb.capture(store=store) as cap:
            run = Runner.run_streamed(agent, text)
            async for _ in run.stream_events():
                pass
        return cap, run

    return asyncio.run(main())


def test_streamed_run_gives_the_same_episode(srv, sqlite_store):
    cap, run = streamed(team(srv.url), "weather in Paris, then bill me", sqlite_store)
    assert run.final_output == "billed: Paris: 21C"
    assert all(r.get("stream") for r in srv.requests[-3:])
    sqlite_store.flush()
    ep = sqlite_store.get_episode(cap.episode_ids[0])
    check_episode(ep)
    assert all(a.metadata["stream_chunks"] > 1 for a in ep.actions if a.kind == "llm")


def test_a_capture_failure_never_reaches_the_run(srv, sqlite_store, monkeypatch):
    def explode(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(openai_agents_runs.Run, "take_call", explode)
    with mb.capture(store=sqlite_store) as cap:
        result = Runner.run_sync(team(srv.url), "weather in Paris, then bill me")
    assert result.final_output == "billed: Paris: 21C"
    assert capture_stats()["by_where"] == {"openai_agents.span_end": 2}  # the tool and the handoff span
    sqlite_store.flush()
    ep = sqlite_store.get_episode(cap.episode_ids[0])
    assert [(a.agent, a.kind) for a in ep.actions] == [("triage", "llm"), ("triage", "llm"), ("billing", "llm")]
    assert ep.metadata["capture_errors"] == 2


def test_one_capture_block_records_langgraph_and_agents_sdk_runs(srv, sqlite_store):
    from typing import TypedDict

    from langgraph.graph import START, StateGraph
    from openai import OpenAI

    class S(TypedDict):
        q: str

    chat = OpenAI(base_url=srv.url, api_key="test", max_retries=0)
    graph = StateGraph(S)
    graph.add_node("asker", lambda s: {"q": chat.chat.completions.create(
        model="helper-model", messages=[{"role": "user", "content": s["q"]}]).choices[0].message.content})
    graph.add_edge(START, "asker")
    with mb.capture(store=sqlite_store) as cap:
        graph.compile().invoke({"q": "hi"})
        Runner.run_sync(team(srv.url), "weather in Paris, then bill me")
    sqlite_store.flush()
    first, second = (sqlite_store.get_episode(e) for e in cap.episode_ids)
    assert [(a.agent, a.output.text) for a in first.actions] == [("asker", "helper says hi")]
    assert (first.source, second.source) == ("langgraph", "openai_agents")
    check_episode(second)


def test_chat_completions_models_give_the_same_episode(srv, sqlite_store):
    with mb.capture(store=sqlite_store) as cap:
        result = Runner.run_sync(team(srv.url, OpenAIChatCompletionsModel), "weather in Paris, then bill me")
    assert result.final_output == "billed: Paris: 21C" and "messages" in srv.requests[-1]
    sqlite_store.flush()
    check_episode(sqlite_store.get_episode(cap.episode_ids[0]))
