"""OTel intake on REAL Google ADK apps: ``AgentTool`` and ``sub_agents`` + ``transfer_to_agent``, run by
``InMemoryRunner`` with scripted models, traced by ADK's own ``telemetry/tracing.py`` into the real
``EpisodeSpanProcessor``. ``tests/test_otel_frameworks.py`` tests the same rules on hand-written spans;
each D here is written by hand from ``docs/capture/dependency-graph.md`` (OpenTelemetry intake).

What ADK (2.13) needs, read from ``google/adk/telemetry/``:
- its tracer is ``trace.get_tracer("gcp.vertex.agent")`` at import: the GLOBAL provider (a proxy until
  one is set), so this module sets one once per process and routes its spans to each test's store;
- the default telemetry schema is v2 (``ADK_TELEMETRY_SCHEMA_VERSION_OPT_IN`` unset or ``2``):
  ``invoke_workflow <root>`` > ``invoke_agent <name>`` > ``generate_content <model>`` and
  ``execute_tool <tool>`` (no ``call_llm`` span; that is schema ``1``), agents named by
  ``gen_ai.agent.name`` on ``invoke_agent`` (also stamped on model and tool spans);
- message content (``gen_ai.input.messages`` / ``gen_ai.output.messages``, ``gen_ai.tool.call.arguments``
  / ``.result``) goes on spans only with ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY``
  (or ``SPAN_AND_EVENT``); ``true`` means EVENT_ONLY (log records, which the processor never sees).
  ``ADK_CAPTURE_MESSAGE_CONTENT_IN_SPANS`` only governs schema 1's ``gcp.vertex.agent.*`` attributes.
No network: the models are ``BaseLlm`` subclasses, nothing points ADK at Google."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("google.adk")

from google.adk.agents import LlmAgent  # noqa: E402
from google.adk.apps import App  # noqa: E402
from google.adk.models import BaseLlm, LlmResponse  # noqa: E402
from google.adk.runners import InMemoryRunner  # noqa: E402
from google.adk.tools.agent_tool import AgentTool  # noqa: E402
from google.genai import types  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402

from otel_views import Route, only_episode, view  # noqa: E402

from marft_bridge.integrations import otel  # noqa: E402


class Scripted(BaseLlm):
    """A scripted model: each call pops the next reply, a text or a ``(tool, args)`` function call.
    ``call_ids`` gives the function calls ids of their own; Gemini's usually have none, and ADK then
    gives the tool its own ``adk-<uuid>`` id."""

    script: list
    call_ids: bool = False

    async def generate_content_async(self, llm_request, stream=False):
        reply = self.script.pop(0)
        if isinstance(reply, str):
            part = types.Part(text=reply)
        else:
            name, args = reply
            part = types.Part(function_call=types.FunctionCall(
                name=name, args=args, id=f"call-{name}" if self.call_ids else None))
        yield LlmResponse(content=types.Content(role="model", parts=[part]))


_ROUTE = Route()


@pytest.fixture(scope="module", autouse=True)
def _global_provider():
    # ADK only traces through the global provider, which can be set once per process.
    tp = trace.get_tracer_provider()
    if not isinstance(tp, TracerProvider):
        tp = TracerProvider()
        trace.set_tracer_provider(tp)
    tp.add_span_processor(_ROUTE)
    yield
    _ROUTE.target = None


@pytest.fixture
def captured(sqlite_store, monkeypatch):
    """Spans of ADK's default schema, with message content on them, into ``sqlite_store``."""
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
    monkeypatch.delenv("ADK_TELEMETRY_SCHEMA_VERSION_OPT_IN", raising=False)
    monkeypatch.delenv("OTEL_SEMCONV_STABILITY_OPT_IN", raising=False)
    _ROUTE.target = otel.EpisodeSpanProcessor(sqlite_store)
    yield sqlite_store
    _ROUTE.target = None


def run(root, text):
    async def go():
        runner = InMemoryRunner(app=App(name="adk-test", root_agent=root))
        session = await runner.session_service.create_session(app_name="adk-test", user_id="u")
        msg = types.Content(role="user", parts=[types.Part(text=text)])
        return [ev async for ev in runner.run_async(user_id="u", session_id=session.id, new_message=msg)]

    return asyncio.run(go())


IDS = pytest.mark.parametrize("call_ids", [False, True], ids=["gemini-no-call-ids", "model-call-ids"])


@IDS
def test_adk_agent_tool_nested_agent_reads_the_asking_call(captured, call_ids):
    """The coordinator asks for ``researcher`` through ``AgentTool``; ADK runs the nested agent while the
    coordinator's ``generate_content`` span is still open (ADK ends it after the tool: the nested
    agent's spans sit under ``execute_tool researcher``, a sibling of that model span)."""
    researcher = LlmAgent(name="researcher", description="looks things up",
                          model=Scripted(model="fake-r", script=["moon pulls"]))
    coordinator = LlmAgent(name="coordinator", tools=[AgentTool(agent=researcher)], model=Scripted(
        model="fake-c", call_ids=call_ids, script=[("researcher", {"request": "tides?"}), "The moon."]))
    events = run(coordinator, "why tides?")
    assert events[-1].content.parts[0].text == "The moon."

    ep = only_episode(captured)
    c0, r0, tool, c1 = ("coordinator:llm:", "coordinator/researcher:llm:moon pulls",
                        'coordinator:tool:{"result":', "coordinator:llm:The moon.")
    assert view(ep) == [
        (c0, []),
        (r0, [c0]),  # first action below the execute_tool span: the call that asked for that tool
        (tool, sorted([c0, r0])),  # the asking call, and the nested agent's answer (its result)
        (c1, sorted([c0, r0, tool])),  # its own earlier call, the tool step and the answer inside it
    ]
    step = ep.actions[2]
    assert step.metadata["tool.name"] == "researcher"
    assert step.metadata["tool.arguments"] == {"request": "tides?"}
    # the nested agent is named by path below the coordinator (the nested invoke_workflow is no agent)
    assert [a.agent for a in ep.actions] == ["coordinator", "coordinator/researcher", "coordinator", "coordinator"]


@IDS
def test_adk_transfer_to_agent_is_a_source_of_the_receiving_agents_first_call(captured, call_ids):
    """``sub_agents`` + ``transfer_to_agent``: ADK shows the receiving agent the coordinator's turn only
    as "For context:" text, so the handoff rule alone carries the edge."""
    billing = LlmAgent(name="billing", description="billing questions",
                       model=Scripted(model="fake-b", script=["Refunded."]))
    coordinator = LlmAgent(name="coordinator", sub_agents=[billing], model=Scripted(
        model="fake-c", call_ids=call_ids, script=[("transfer_to_agent", {"agent_name": "billing"})]))
    events = run(coordinator, "charged twice")
    assert (events[-1].author, events[-1].content.parts[0].text) == ("billing", "Refunded.")

    ep = only_episode(captured)
    c0, t, b0 = "coordinator:llm:", 'coordinator:tool:{"result":', "billing:llm:Refunded."
    assert view(ep) == [
        (c0, []),
        (t, [c0]),  # the call that asked for the transfer (its arguments are what the tool read)
        (b0, [t]),  # the handoff, not the coordinator's call: billing is no agent around it
    ]
    assert ep.actions[1].metadata["tool.name"] == "transfer_to_agent"
    assert ep.actions[1].metadata["tool.arguments"] == {"agent_name": "billing"}


def test_adk_model_spans_carry_the_conversation(captured):
    """Content capture reaches the records: the prompt, the offered tools and the tool call."""
    billing = LlmAgent(name="billing", description="billing questions",
                       model=Scripted(model="fake-b", script=["Refunded."]))
    coordinator = LlmAgent(name="coordinator", sub_agents=[billing], model=Scripted(
        model="fake-c", script=[("transfer_to_agent", {"agent_name": "billing"})]))
    run(coordinator, "charged twice")

    first = only_episode(captured).actions[0]
    assert first.observation.messages[-1].content == "charged twice"
    assert "transfer_to_agent" in [t["function"]["name"] for t in first.observation.tools or []]
    (call,) = first.output.tool_calls
    assert call["function"]["name"] == "transfer_to_agent"
    assert call["function"]["arguments"] == '{"agent_name": "billing"}'
