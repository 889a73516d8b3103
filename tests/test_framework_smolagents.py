"""OTel intake on REAL smolagents apps (smolagents 1.26) traced by the real OpenInference instrumentor
(``openinference-instrumentation-smolagents`` 0.1.43) into the real ``EpisodeSpanProcessor``: a
``ToolCallingAgent`` with a ``@tool``, and a manager calling a managed agent. The models are scripted
``smolagents.Model`` subclasses (no network). Each D is written by hand from the rules in
``docs/capture/dependency-graph.md`` (OpenTelemetry intake); ``tests/test_otel_frameworks.py`` checks
the same rules on hand-written spans.

What the instrumentor emits: ``<agent name or class>.run`` (``openinference.span.kind`` AGENT; a
managed agent's run span sits directly under the manager's step, there is no TOOL span for it) >
``Step <n>`` (CHAIN) > ``<ModelClass>.generate`` (LLM: ``llm.model_name``, ``llm.input_messages.*``,
``llm.output_messages.*`` with ``message.tool_calls.*``) and ``<ToolClass>`` (TOOL, ``SimpleTool``
for a ``@tool``, ``FinalAnswerTool``: ``tool.name``, ``input.value`` = ``{"args": [],
"sanitize_inputs_outputs": true, "kwargs": {...}}``, ``output.value``; no tool call id)."""

from __future__ import annotations

import json

import pytest

smolagents = pytest.importorskip("smolagents")
pytest.importorskip("openinference.instrumentation.smolagents")

from openinference.instrumentation.smolagents import SmolagentsInstrumentor  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from smolagents import Model, ToolCallingAgent, tool  # noqa: E402
from smolagents.models import ChatMessage, ChatMessageToolCall, ChatMessageToolCallFunction  # noqa: E402
from smolagents.monitoring import TokenUsage  # noqa: E402

from otel_views import only_episode, view  # noqa: E402

from marft_bridge.integrations import otel  # noqa: E402


class Scripted(Model):
    """A model that plays its turns in order, each ``(content, tool name, call id, arguments)``: one
    tool call (smolagents' ToolCallingAgent acts only through tool calls, ``final_answer`` included).
    One instance per agent."""

    def __init__(self, *turns):
        super().__init__(model_id="fake-model")
        self.turns = list(turns)

    def generate(self, messages, stop_sequences=None, response_format=None, tools_to_call_from=None, **kw):
        content, name, call_id, args = self.turns.pop(0)
        call = ChatMessageToolCall(id=call_id, type="function",
                                   function=ChatMessageToolCallFunction(name=name, arguments=json.dumps(args)))
        # token_usage: the instrumentor reads it (else ``last_input_token_count``, gone from Model)
        return ChatMessage(role="assistant", content=content, tool_calls=[call],
                           token_usage=TokenUsage(input_tokens=1, output_tokens=1))


@pytest.fixture
def captured(sqlite_store, monkeypatch):
    """The instrumentor on a provider of this test's own (never the global one), undone afterwards.
    It wraps ``generate`` only on the ``Model`` classes ``smolagents`` exports, so a custom model that
    overrides ``generate`` gives no LLM spans unless exported there too: ``Scripted`` is, for the test."""
    monkeypatch.setattr(smolagents, "Scripted", Scripted, raising=False)
    models = [c for c in vars(smolagents).values() if isinstance(c, type) and issubclass(c, Model)]
    inherited = [c for c in models if "generate" not in c.__dict__]
    tp = TracerProvider()
    tp.add_span_processor(otel.EpisodeSpanProcessor(sqlite_store))
    inst = SmolagentsInstrumentor()
    inst.instrument(tracer_provider=tp)
    try:
        yield sqlite_store
    finally:
        inst.uninstrument()
        # uninstrument() leaves a wrapper (bound to this provider) on the classes that inherit
        # ``generate`` (ApiModel, LiteLLMRouterModel, AzureOpenAIModel): take it off, so nothing leaks
        for c in inherited:
            if "generate" in c.__dict__:
                delattr(c, "generate")
        tp.shutdown()


@tool
def tide_table(port: str) -> str:
    """The next high tide at a port.

    Args:
        port: the port's name
    """
    return f"high tide at {port}: 06:12"


@tool
def shout(text: str) -> str:
    """The text in capitals.

    Args:
        text: what to shout
    """
    return text.upper()


def test_single_agent_model_tool_model(captured):
    """One agent, one tool: the tool step depends on the call that asked for it (its input is that
    call's arguments), the next call on the tool's result and the agent's earlier call."""
    model = Scripted(("Shouting it.", "shout", "c-1", {"text": "ahoy"}),
                     ("Got it.", "final_answer", "c-2", {"answer": "AHOY said"}))
    agent = ToolCallingAgent(tools=[shout], model=model, name="solo", max_steps=3, verbosity_level=0)
    assert agent.run("Shout ahoy.") == "AHOY said"
    ep = only_episode(captured)
    assert [(a.agent, a.kind, a.metadata.get("tool.name")) for a in ep.actions] == [
        ("solo", "llm", None), ("solo", "tool", "shout"), ("solo", "llm", None), ("solo", "tool", "final_answer")]
    # the tool's own arguments, as the model sent them (the span's input.value wraps them in
    # ``Tool.__call__``'s bound arguments: ``{"args": [], "sanitize_inputs_outputs": true, "kwargs": ...}``)
    assert [a.metadata["tool.arguments"] for a in ep.actions if a.kind == "tool"] == [{"text": "ahoy"},
                                                                                      {"answer": "AHOY said"}]
    m0, t, m1, f = "solo:llm:Shouting i", "solo:tool:AHOY", "solo:llm:Got it.", "solo:tool:AHOY said"
    assert view(ep) == [
        (m0, []),
        (t, [m0]),  # the call that asked (tool name and arguments: no call id on the tool span)
        (m1, sorted([m0, t])),  # its own earlier call, and the tool result in its input
        (f, [m1]),  # final_answer reads the arguments of the call that asked for it, nothing else
    ]


def test_managed_agent_is_named_by_its_agent_span_and_fed_by_the_managers_call(captured):
    """A manager calls a managed agent like a tool: the managed agent's run span sits under the
    manager's step (no tool span), so its actions are ``manager/researcher``'s; its first call depends
    on the manager's call that asked for it, and the manager's next call on what it returned."""
    researcher = ToolCallingAgent(
        tools=[tide_table], name="researcher", description="Looks up tide times.", max_steps=3, verbosity_level=0,
        model=Scripted(("Looking it up.", "tide_table", "r-1", {"port": "Brest"}),
                       ("Found it.", "final_answer", "r-2", {"answer": "06:12 in Brest"})))
    manager = ToolCallingAgent(
        tools=[shout], managed_agents=[researcher], name="manager", max_steps=3, verbosity_level=0,
        model=Scripted(("Asking the researcher.", "researcher", "m-1", {"task": "Next high tide in Brest?"}),
                       ("Reporting.", "final_answer", "m-2", {"answer": "06:12"})))
    assert manager.run("When is high tide in Brest?") == "06:12"
    ep = only_episode(captured)
    R = "manager/researcher"  # nested AGENT spans join into a path
    assert [(a.agent, a.kind, a.metadata.get("tool.name")) for a in ep.actions] == [
        ("manager", "llm", None), (R, "llm", None), (R, "tool", "tide_table"), (R, "llm", None),
        (R, "tool", "final_answer"), ("manager", "llm", None), ("manager", "tool", "final_answer")]
    assert {a.policy.name for a in ep.actions if a.kind == "llm"} == {"fake-model"}  # the model id, not the agent
    m0, r0, t, r1 = "manager:llm:Asking the", f"{R}:llm:Looking it", f"{R}:tool:high tide ", f"{R}:llm:Found it."
    rf, m1, mf = f"{R}:tool:06:12 in B", "manager:llm:Reporting.", "manager:tool:06:12"
    assert view(ep) == [
        (m0, []),
        (r0, [m0]),  # the managed agent's first call: the manager's call that asked for it (parentage)
        (t, [r0]),  # the researcher's call that asked for the tool
        (r1, sorted([m0, r0, t])),  # its agents' earlier calls, and the tool result in its input
        (rf, [r1]),
        (m1, sorted([m0, rf])),  # what the researcher returned is in its input; not the researcher's inner steps
        (mf, [m1]),
    ]
