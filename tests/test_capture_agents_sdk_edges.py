"""OpenAI Agents SDK apps the way people set them up: the README's processor advice followed before
capture starts (or the processor registered twice), tracing switched off, and an agent used as a
tool (``agent.as_tool``) in ``run_sync`` and ``run_streamed``. Exact agents, kinds and D."""

from __future__ import annotations

import asyncio
import logging

import pytest
from agents import Agent, OpenAIResponsesModel, Runner, add_trace_processor, set_trace_processors, set_tracing_disabled
from fake_responses import FakeServer
from openai import AsyncOpenAI
from test_capture_agents_sdk import check_episode, streamed, team

import marft_bridge as mb
from marft_bridge.integrations import openai_agents
from marft_bridge.capture.recording import capture_stats, reset_capture_stats


@pytest.fixture(scope="module")
def srv():
    with FakeServer() as s:
        yield s


@pytest.fixture(autouse=True)
def _only_our_processor(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    set_trace_processors([openai_agents.trace_processor()])  # the README's advice, before any capture
    reset_capture_stats()
    yield
    set_tracing_disabled(False)
    openai_agents.uninstrument()  # the next test starts without a capture state


def _processors():
    return openai_agents.registered_processors()


def run_one(srv, sqlite_store):
    with mb.capture(store=sqlite_store) as cap:
        assert Runner.run_sync(team(srv.url), "weather in Paris, then bill me").final_output == "billed: Paris: 21C"
    assert len(cap.episode_ids) == 1
    sqlite_store.flush()
    return sqlite_store.get_episode(cap.episode_ids[0])


def test_the_apps_own_processor_list_gets_no_second_processor(srv, sqlite_store):
    ep = run_one(srv, sqlite_store)
    check_episode(ep)  # one tool step per tool, one handoff step
    assert [type(p).__name__ for p in _processors()] == ["EpisodeTraceProcessor"]
    assert capture_stats()["errors"] == 0


def test_a_processor_registered_twice_still_records_each_step_once(srv, sqlite_store):
    add_trace_processor(openai_agents.trace_processor())  # an app that followed the advice twice
    assert len(_processors()) == 2
    check_episode(run_one(srv, sqlite_store))


def test_capture_first_then_the_apps_list_replaces_it(srv, sqlite_store):
    set_trace_processors([])
    with mb.capture(store=sqlite_store) as cap:
        assert len(_processors()) == 1  # capture added it
        set_trace_processors([openai_agents.trace_processor()])  # the app sets its list afterwards
        Runner.run_sync(team(srv.url), "weather in Paris, then bill me")
    sqlite_store.flush()
    check_episode(sqlite_store.get_episode(cap.episode_ids[0]))
    assert _processors() == [openai_agents.trace_processor()]


def test_capture_takes_out_the_processor_it_added(srv, sqlite_store):
    set_trace_processors([])
    with mb.capture(store=sqlite_store):
        assert _processors() == [openai_agents.trace_processor()]
    openai_agents.uninstrument()
    assert _processors() == []


def test_with_tracing_disabled_one_warning_names_the_fix(srv, sqlite_store, caplog):
    set_tracing_disabled(True)
    with caplog.at_level(logging.WARNING, logger="marft_bridge.capture"):
        with mb.capture(store=sqlite_store) as cap:
            for _ in range(2):
                assert Runner.run_sync(team(srv.url), "weather in Paris, then bill me").final_output == "billed: Paris: 21C"
    warnings = [r.getMessage() for r in caplog.records if "tracing disabled" in r.getMessage()]
    assert len(warnings) == 1
    assert "set_trace_processors([marft_bridge.integrations.openai_agents.trace_processor()])" in warnings[0]
    assert cap.episode_ids == []
    assert capture_stats()["errors"] == 0


# -- an agent used as a tool ---------------------------------------------------------------------------


def lead_team(url: str):
    client = AsyncOpenAI(base_url=url, api_key="test", max_retries=0)
    helper = Agent(name="helper", instructions="You help.", model=OpenAIResponsesModel("helper-model", client))
    return Agent(name="lead", instructions="You lead.", model=OpenAIResponsesModel("lead-model", client),
                 tools=[helper.as_tool(tool_name="ask_helper", tool_description="Ask the helper.")])


def check_delegation(ep):
    acts = ep.actions
    assert [(a.agent, a.kind) for a in acts] == [("lead", "llm"), ("helper", "llm"), ("lead", "tool"), ("lead", "llm")]
    ask, helped, tool, answer = acts
    assert ask.output.tool_calls[0]["function"]["name"] == "ask_helper"
    # the nested agent's first call reads the asking call's tool call (its input)
    assert helped.depends_on == [ask.id]
    assert helped.observation.messages[-1].content == "capital of France?"
    assert helped.output.text == "helper says capital of France?"
    # the tool step returns the nested agent's final answer
    assert sorted(tool.depends_on) == sorted([ask.id, helped.id])
    assert tool.output.text == "helper says capital of France?" and tool.metadata["tool.name"] == "ask_helper"
    assert tool.metadata["tool_call_id"] == "call_helper"
    assert sorted(answer.depends_on) == sorted([ask.id, helped.id, tool.id])
    assert answer.output.text == "lead: helper says capital of France?"


def test_an_agent_as_a_tool_is_linked_through_the_span_tree(srv, sqlite_store):
    with mb.capture(store=sqlite_store) as cap:
        out = Runner.run_sync(lead_team(srv.url), "what is the capital of France?")
    assert out.final_output == "lead: helper says capital of France?"
    sqlite_store.flush()
    check_delegation(sqlite_store.get_episode(cap.episode_ids[0]))
    assert capture_stats()["errors"] == 0


def test_an_agent_as_a_tool_streamed(srv, sqlite_store):
    cap, run = streamed(lead_team(srv.url), "what is the capital of France?", sqlite_store)
    assert run.final_output == "lead: helper says capital of France?"
    sqlite_store.flush()
    check_delegation(sqlite_store.get_episode(cap.episode_ids[0]))


# -- an MCP tool inside a function tool ------------------------------------------------------------


def test_an_mcp_call_inside_a_function_tool_is_that_tool_step(srv, sqlite_store):
    """The SDK's function span is the tool step; the MCP call made in its body enriches it, and the
    server's half joins to it (one step per tool execution)."""
    import mcp_apps
    from agents import function_tool

    from marft_bridge.integrations import mcp as mcp_capture
    from marft_bridge.integrations.crossprocess import propagation as prop

    server = mcp_capture.instrument_server(mcp_apps.build_server(), store=sqlite_store)

    async def main():
        async with mcp_apps.session(server) as session:
            mcp_capture.instrument_client(session)

            @function_tool
            async def lookup(city: str) -> str:
                """The weather in a city."""
                out = await session.call_tool("add", {"a": 20, "b": 1})
                return f"{city}: {mcp_capture.result_text(out)[0]}C"

            client = AsyncOpenAI(base_url=srv.url, api_key="test", max_retries=0)
            billing = Agent(name="billing", instructions="You bill.", model=OpenAIResponsesModel("billing-model", client))
            triage = Agent(name="triage", instructions="You route.", tools=[lookup], handoffs=[billing],
                           model=OpenAIResponsesModel("triage-model", client))
            with mb.capture(store=sqlite_store) as cap:
                await Runner.run(triage, "weather in Paris, then bill me")
            return cap

    cap = asyncio.run(main())
    sqlite_store.flush()
    assert prop.flush_joins(sqlite_store, timeout=60)
    ep = sqlite_store.get_episode(cap.episode_ids[0])
    assert [(a.agent, a.kind) for a in ep.actions] == [
        ("triage", "llm"), ("triage", "tool"), ("calc", "tool"), ("triage", "llm"), ("triage", "tool"), ("billing", "llm")]
    plan = ep.actions[0]
    step = next(a for a in ep.actions if a.kind == "tool" and a.metadata.get("tool.name") == "lookup")
    served = next(a for a in ep.actions if a.agent == "calc")
    assert step.depends_on == [plan.id] and step.output.text == "Paris: 21C"
    assert (step.metadata["mcp.tool"], step.metadata["mcp.arguments"]) == ("add", {"a": 20, "b": 1})
    assert served.depends_on == [step.id]
    assert capture_stats()["errors"] == 0


def test_parallel_calls_of_one_tool_with_the_same_arguments_keep_their_own_results(srv, sqlite_store):
    """One reply asks ``weather`` three times at once, twice for Paris; the first Paris call ends last
    (it waits for the second), so pairing by end order would swap the two Paris results."""
    from agents import function_tool

    state: dict = {"paris": 0, "second": None}

    @function_tool
    async def weather(city: str) -> str:
        """The weather in a city."""
        if city != "Paris":
            return f"{city}: sun"
        state["paris"] += 1
        k = state["paris"]
        state["second"] = state["second"] or asyncio.Event()
        if k == 1:
            await asyncio.wait_for(state["second"].wait(), 30)  # the SDK runs one reply's calls concurrently
        else:
            state["second"].set()
        return f"Paris#{k}: rain"

    client = AsyncOpenAI(base_url=srv.url, api_key="test", max_retries=0)
    agent = Agent(name="forecaster", tools=[weather], model=OpenAIResponsesModel("forecast-model", client))
    with mb.capture(store=sqlite_store) as cap:
        Runner.run_sync(agent, "weather?")
    sent = {i["call_id"]: i["output"] for i in srv.requests[-1]["input"] if i.get("type") == "function_call_output"}
    assert sent == {"call_p": "Paris#1: rain", "call_r": "Rome: sun", "call_p2": "Paris#2: rain"}
    sqlite_store.flush()
    ep = sqlite_store.get_episode(cap.episode_ids[0])
    steps = [a for a in ep.actions if a.kind == "tool"]
    assert {a.metadata["tool_call_id"]: a.output.text for a in steps} == sent  # what the model was told
    assert all(a.depends_on == [ep.actions[0].id] for a in steps)
    assert capture_stats()["errors"] == 0


def test_the_agent_handed_to_depends_on_the_handoff_its_input_filter_removed(srv, sqlite_store):
    """``handoff(..., input_filter=handoff_filters.remove_all_tools)``: the receiver's input holds no
    tool items, the transfer call and its result included; it still read the handoff."""
    from agents import function_tool, handoff
    from agents.extensions import handoff_filters

    @function_tool
    def lookup(city: str) -> str:
        """The weather in a city."""
        return f"{city}: 21C"

    client = AsyncOpenAI(base_url=srv.url, api_key="test", max_retries=0)
    billing = Agent(name="billing", instructions="You bill.", model=OpenAIResponsesModel("billing-model", client))
    triage = Agent(name="triage", instructions="You route.", tools=[lookup],
                   handoffs=[handoff(billing, input_filter=handoff_filters.remove_all_tools)],
                   model=OpenAIResponsesModel("triage-model", client))
    with mb.capture(store=sqlite_store) as cap:
        assert Runner.run_sync(triage, "weather in Paris, then bill me").final_output == "billed: ?"  # no tool output
    sqlite_store.flush()
    ep = sqlite_store.get_episode(cap.episode_ids[0])
    plan, lookup_step, route, transfer, bill = ep.actions
    assert [(a.agent, a.kind) for a in ep.actions] == [
        ("triage", "llm"), ("triage", "tool"), ("triage", "llm"), ("triage", "tool"), ("billing", "llm")]
    assert transfer.metadata["handoff.goto"] == "billing" and transfer.depends_on == [route.id]
    assert not any(m.role == "tool" or m.tool_calls for m in bill.observation.messages)
    assert transfer.id in bill.depends_on
    assert capture_stats()["errors"] == 0


@pytest.mark.parametrize("explain", [True, False], ids=["failure_error_function", "sdk_default"])
def test_a_failed_function_tool_step_carries_what_the_sdk_says_of_the_exception(srv, sqlite_store, explain):
    from agents import function_tool

    def failure(ctx, error: Exception) -> str:
        return f"lookup failed: {error}"

    @function_tool(**({"failure_error_function": failure} if explain else {}))
    def lookup(city: str) -> str:
        """The weather in a city."""
        raise ValueError(f"no station in {city}")

    client = AsyncOpenAI(base_url=srv.url, api_key="test", max_retries=0)
    billing = Agent(name="billing", instructions="You bill.", model=OpenAIResponsesModel("billing-model", client))
    triage = Agent(name="triage", instructions="You route.", tools=[lookup], handoffs=[billing],
                   model=OpenAIResponsesModel("triage-model", client))
    with mb.capture(store=sqlite_store) as cap:
        Runner.run_sync(triage, "weather in Paris, then bill me")
    sqlite_store.flush()
    ep = sqlite_store.get_episode(cap.episode_ids[0])
    plan, step = ep.actions[0], ep.actions[1]
    assert (step.kind, step.agent, step.depends_on) == ("tool", "triage", [plan.id])
    if explain:  # the app let the exception through: the step says what failed
        assert step.output.text == "lookup failed: no station in Paris"
        assert step.error == "Error running tool (non-fatal): no station in Paris"
    else:  # the SDK's default keeps the exception out of the trace: so does the step
        assert "no station" not in (step.error or "") + step.output.text
        assert step.error.startswith("Error running tool") and "redacted" in step.error
    assert capture_stats()["errors"] == 0


def test_a_run_stopped_by_an_input_guardrail_is_a_failed_episode(srv, sqlite_store):
    from agents import GuardrailFunctionOutput, InputGuardrailTripwireTriggered, input_guardrail

    client = AsyncOpenAI(base_url=srv.url, api_key="test", max_retries=0)
    classifier = Agent(name="classifier", instructions="Classify.", model=OpenAIResponsesModel("echo-model", client))

    @input_guardrail(run_in_parallel=False)
    async def screen(ctx, agent, text):
        verdict = (await Runner.run(classifier, text, context=ctx.context)).final_output
        return GuardrailFunctionOutput(output_info=verdict, tripwire_triggered="hack" in verdict)

    main = Agent(name="main", instructions="Answer.", model=OpenAIResponsesModel("echo-model", client),
                 input_guardrails=[screen])
    with mb.capture(store=sqlite_store) as cap:
        assert Runner.run_sync(main, "hello").final_output == "echo: hello"
        with pytest.raises(InputGuardrailTripwireTriggered):
            Runner.run_sync(main, "hack the bank")
    sqlite_store.flush()
    passed, stopped = (sqlite_store.get_episode(i) for i in cap.episode_ids)
    assert (passed.status, [a.agent for a in passed.actions]) == ("completed", ["classifier", "main"])
    assert (stopped.status, [a.agent for a in stopped.actions]) == ("failed", ["classifier"])
    assert "guardrail" in stopped.metadata["error"].lower()
    assert capture_stats()["errors"] == 0


def test_an_mcp_tool_of_an_sdk_agent_is_one_step_with_the_text_the_model_got(srv, sqlite_store):
    """An SDK agent with a real MCP server over stdio (``MCPServerStdio``): the tool step's output is
    the tool's text, as the model's next input has it (the span holds MCP content parts)."""
    import os
    import sys

    from agents.mcp import MCPServerStdio

    here = os.path.dirname(os.path.abspath(__file__))
    params = {"command": sys.executable, "args": ["-c", "import mcp_apps; mcp_apps.build_server().run('stdio')"],
              "cwd": here}

    async def main():
        client = AsyncOpenAI(base_url=srv.url, api_key="test", max_retries=0)
        async with MCPServerStdio(params=params, name="calc", cache_tools_list=True) as server:
            agent = Agent(name="planner", mcp_servers=[server], model=OpenAIResponsesModel("planner-mcp", client))
            with mb.capture(store=sqlite_store) as cap:
                assert (await Runner.run(agent, "compute")).final_output == "planner-mcp result=5"
        return cap.episode_ids

    (eid,) = asyncio.run(main())
    sqlite_store.flush()
    ask, add, answer = sqlite_store.get_episode(eid).actions
    assert [(a.agent, a.kind) for a in (ask, add, answer)] == [("planner", "llm"), ("planner", "tool"), ("planner", "llm")]
    told = [m.content for m in answer.observation.messages if m.role == "tool"]
    assert add.output.text == "5" and told == ["5"]
    assert add.depends_on == [ask.id] and sorted(answer.depends_on) == sorted([ask.id, add.id])
    assert capture_stats()["errors"] == 0
