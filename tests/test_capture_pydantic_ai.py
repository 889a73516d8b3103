"""A real pydantic-ai app over OpenTelemetry: a boss agent with a plain tool (``add``) and an agent
as a tool (``ask_helper`` runs a helper agent), its OpenAI model pointed at the scripted local
server, pydantic-ai's ``InstrumentationSettings`` -> OTel SDK -> our ``EpisodeSpanProcessor``.
Exact agents, kinds, tool steps, tool messages, tools offered and D."""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace import TracerProvider
from pydantic_ai import Agent
from pydantic_ai.models.instrumented import InstrumentationSettings
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from marft_bridge.integrations import otel
from marft_bridge.capture.recording import capture_stats, reset_capture_stats
from fake_responses import FakeServer


@pytest.fixture(scope="module")
def srv():
    with FakeServer() as s:
        yield s


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    reset_capture_stats()


def run_team(url: str, store) -> str:
    tp = TracerProvider()
    tp.add_span_processor(otel.EpisodeSpanProcessor(store))
    settings = InstrumentationSettings(tracer_provider=tp)
    provider = OpenAIProvider(base_url=url, api_key="test")
    helper = Agent(OpenAIChatModel("helper-model", provider=provider), name="helper", instructions="You help.")
    boss = Agent(OpenAIChatModel("boss-model", provider=provider), name="boss", instructions="You lead.")

    @boss.tool_plain
    async def ask_helper(question: str) -> str:
        """Ask the helper agent."""
        return (await helper.run(question)).output

    @boss.tool_plain
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    helper.instrument = boss.instrument = settings
    return boss.run_sync("plan it").output


def test_agent_as_a_tool_and_a_tool_over_otel(srv, sqlite_store):
    assert run_team(srv.url, sqlite_store) == "boss: helper says capital of France? | 5"
    sqlite_store.flush()
    (ep,) = list(sqlite_store.episodes())
    acts = ep.actions
    assert [(a.agent, a.kind, a.step) for a in acts] == [
        ("boss", "llm", 1), ("boss/helper", "llm", 2), ("boss", "tool", 3), ("boss", "llm", 4),
        ("boss", "tool", 5), ("boss", "llm", 6)]
    ask, helper, ask_tool, add_call, add_tool, answer = acts
    # the helper's answer is an input of the tool step that returned it (recorded at the tool's end)
    assert ask_tool.depends_on == [ask.id, helper.id]
    assert helper.depends_on == [ask.id]
    assert add_call.depends_on == [ask.id, helper.id, ask_tool.id]
    assert add_tool.depends_on == [add_call.id]  # the call that asked (gen_ai.tool.call.id), not the span's history
    assert answer.depends_on == [ask.id, helper.id, ask_tool.id, add_call.id, add_tool.id]
    # tool steps in the MCP / LangChain shape, with the call id that links them
    assert ask_tool.output.text == "helper says capital of France?"
    assert ask_tool.metadata["tool.name"] == "ask_helper" and ask_tool.metadata["tool_call_id"] == "call_helper"
    assert ask_tool.observation.messages[0].tool_calls == [
        {"id": "call_helper", "type": "function", "function": {"name": "ask_helper",
                                                               "arguments": '{"question":"capital of France?"}'}}]
    assert (add_tool.output.text, add_tool.metadata["tool.arguments"]) == ("5", {"a": 2, "b": 3})
    # tool_call_response parts are tool messages answering their call
    tool_msgs = [(m.tool_call_id, m.content) for m in answer.observation.messages if m.role == "tool"]
    assert tool_msgs == [("call_helper", "helper says capital of France?"), ("call_add", "5")]
    assert [m.role for m in answer.observation.messages] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert answer.observation.messages[0].content == "You lead."
    assert ask.output.tool_calls[0]["function"] == {"name": "ask_helper",
                                                    "arguments": '{"question": "capital of France?"}'}
    # gen_ai.tool.definitions -> Observation.tools (chat shape)
    assert [t["function"]["name"] for t in ask.observation.tools] == ["ask_helper", "add"]
    assert ask.observation.tools[1]["function"]["parameters"]["properties"] == {
        "a": {"type": "integer"}, "b": {"type": "integer"}}
    assert helper.observation.tools is None and helper.output.text == "helper says capital of France?"
    assert [a.policy.name for a in acts if a.kind == "llm"] == ["boss-model", "helper-model", "boss-model", "boss-model"]
    assert capture_stats()["errors"] == 0


def test_unknown_message_parts_are_kept_as_text_and_counted(sqlite_store):
    tp = TracerProvider()
    tp.add_span_processor(otel.EpisodeSpanProcessor(sqlite_store))
    tracer = tp.get_tracer("app")
    parts = [{"type": "text", "content": "look: "}, {"type": "uri", "uri": "https://x/cat.png", "modality": "image"},
             {"type": "reasoning", "content": "hmm"}]
    with tracer.start_as_current_span("chat m", attributes={
            "gen_ai.operation.name": "chat", "gen_ai.request.model": "m",
            "gen_ai.input.messages": json.dumps([{"role": "user", "parts": parts}])}):
        pass
    sqlite_store.flush()
    (ep,) = list(sqlite_store.episodes())
    (a,) = ep.actions
    uri = json.dumps(parts[1])
    assert a.observation.messages[0].content == f"look: {uri}hmm"
    assert a.metadata["unknown_parts"] == ["uri", "reasoning"]
    assert capture_stats()["by_where"] == {"otel.unknown_part": 1}
