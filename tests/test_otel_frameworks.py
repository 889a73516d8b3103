"""OTel intake on the span shapes of Google ADK (``AgentTool`` inside a model call's still-open span,
``transfer_to_agent``), Strands Agents (swarm ``handoff_to_agent``), smolagents through OpenInference
(``AGENT`` spans) and the GenAI conventions 0.1.0 (a workflow keyed on ``gen_ai.agent.name``, span links).

Each trace here is written span by span in the shape that framework's tracing code emits or has
emitted (span names, parentage, attribute keys: ADK's ``telemetry/tracing.py``, Strands' tracer,
``openinference-instrumentation-smolagents``' wrappers), through the real OpenTelemetry SDK into the
real ``EpisodeSpanProcessor``. Each D is written by hand. The real frameworks: ``tests/test_framework_*.py``."""

from __future__ import annotations

import json

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry import trace as otel_trace
from opentelemetry.trace import Link

from otel_views import only_episode, view

from marft_bridge.integrations import otel

J = json.dumps


def collect(store):
    tp = TracerProvider()
    tp.add_span_processor(otel.EpisodeSpanProcessor(store))
    return tp.get_tracer("app")


def user(text):
    return {"role": "user", "parts": [{"type": "text", "content": text}]}


def adk_call(tracer, model, inputs, parts):
    """ADK's ``call_llm`` span (with the GenAI content attributes of its experimental semconv)."""
    return tracer.start_as_current_span("call_llm", attributes={
        "gen_ai.system": "gcp.vertex.agent", "gen_ai.operation.name": "generate_content", "gen_ai.request.model": model,
        "gen_ai.input.messages": J(inputs), "gen_ai.output.messages": J([{"role": "assistant", "parts": parts}])})


def adk_tool(tracer, name, call_id, args, response, tool_type="FunctionTool"):
    return tracer.start_as_current_span(f"execute_tool {name}", attributes={
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name, "gen_ai.tool.type": tool_type,
        "gen_ai.tool.call.id": call_id, "gcp.vertex.agent.tool_call_args": J(args),
        "gcp.vertex.agent.tool_response": J(response)})


def agent(tracer, name):
    return tracer.start_as_current_span(f"invoke_agent {name}", attributes={
        "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": name})


def test_adk_agent_tool_inside_the_open_model_call_span(sqlite_store):
    """ADK runs an ``AgentTool`` while the coordinator's ``call_llm`` span is still open: the nested
    agent's first call depends on that call (its request is the tool call's argument)."""
    tracer = collect(sqlite_store)
    ask = {"type": "tool_call", "id": "adk-1", "name": "researcher", "arguments": {"request": "tides?"}}
    with tracer.start_as_current_span("invocation"):
        with agent(tracer, "coordinator"):
            with adk_call(tracer, "gemini-c", [user("why tides?")], [ask]):
                with adk_tool(tracer, "researcher", "adk-1", {"request": "tides?"}, {"result": "moon pulls"},
                              tool_type="AgentTool"):
                    with agent(tracer, "researcher"):
                        with adk_call(tracer, "gemini-r", [user('{"request": "tides?"}')],
                                      [{"type": "text", "content": "moon pulls"}]):
                            pass
            answer = {"role": "tool", "parts": [{"type": "tool_call_response", "id": "adk-1", "response": "moon pulls"}]}
            with adk_call(tracer, "gemini-c", [user("why tides?"), {"role": "assistant", "parts": [ask]}, answer],
                          [{"type": "text", "content": "The moon."}]):
                pass
    c0, r0, tool, c1 = ("coordinator:llm:", "coordinator/researcher:llm:moon pulls",
                        'coordinator:tool:{"result":', "coordinator:llm:The moon.")
    assert view(only_episode(sqlite_store)) == [
        (c0, []),
        (r0, [c0]),  # the open call that asked for the agent tool
        (tool, sorted([c0, r0])),  # the call that asked (by call id) and the agent's answer in its result
        (c1, sorted([c0, r0, tool])),
    ]


def test_adk_transfer_to_agent_is_a_source_of_the_receiving_agents_first_call(sqlite_store):
    tracer = collect(sqlite_store)
    hand = {"type": "tool_call", "id": "adk-2", "name": "transfer_to_agent", "arguments": {"agent_name": "billing"}}
    with tracer.start_as_current_span("invocation"):
        with agent(tracer, "coordinator"):
            with adk_call(tracer, "gemini-c", [user("charged twice")], [hand]):
                pass
            with adk_tool(tracer, "transfer_to_agent", "adk-2", {"agent_name": "billing"}, {"result": None}):
                pass
        with agent(tracer, "billing"):  # ADK shows another agent's turns as context text, not as tool calls
            with adk_call(tracer, "gemini-b", [user("charged twice"), user(
                    "For context: [coordinator] called tool `transfer_to_agent` with parameters: {'agent_name': 'billing'}")],
                    [{"type": "text", "content": "Refunded."}]):
                pass
    c0, t, b0 = "coordinator:llm:", 'coordinator:tool:{"result":', "billing:llm:Refunded."
    ep = only_episode(sqlite_store)
    assert view(ep) == [(c0, []), (t, [c0]), (b0, [t])]
    assert ep.actions[1].metadata["tool.arguments"] == {"agent_name": "billing"}


def test_strands_swarm_handoff_to_agent_is_a_source_of_the_next_node(sqlite_store):
    tracer = collect(sqlite_store)

    def chat(model, inputs, parts):
        return tracer.start_as_current_span("chat", attributes={
            "gen_ai.operation.name": "chat", "gen_ai.request.model": model, "gen_ai.input.messages": J(inputs),
            "gen_ai.output.messages": J([{"role": "assistant", "parts": parts}])})

    args = {"agent_name": "coder", "message": "write the parser", "context": {}}
    with tracer.start_as_current_span("invoke_swarm", attributes={"gen_ai.operation.name": "invoke_swarm"}):
        with agent(tracer, "researcher"):
            with tracer.start_as_current_span("execute_event_loop_cycle"):
                with chat("m1", [user("build a parser")], [{"type": "tool_call", "id": "t-1", "name": "handoff_to_agent",
                                                             "arguments": args}]):
                    pass
                with tracer.start_as_current_span("execute_tool handoff_to_agent", attributes={
                        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "handoff_to_agent",
                        "gen_ai.tool.call.id": "t-1", "gen_ai.tool.call.arguments": J(args),
                        "gen_ai.tool.call.result": "Handing off to coder"}):
                    pass
        with agent(tracer, "coder"):
            with tracer.start_as_current_span("execute_event_loop_cycle"):
                with chat("m2", [user("build a parser"), user("Handoff Message: write the parser")],
                          [{"type": "text", "content": "def parse(): ..."}]):
                    pass
    r0, t, c0 = "researcher:llm:", "researcher:tool:Handing of", "coder:llm:def parse("
    assert view(only_episode(sqlite_store)) == [(r0, []), (t, [r0]), (c0, [t])]


def test_openinference_agent_spans_name_agents_and_own_their_tool_spans(sqlite_store):
    """smolagents through OpenInference: ``<Class>.run`` AGENT spans, ``Step n`` CHAIN spans, LLM spans
    named by the model class, TOOL spans with no agent attribute of their own."""
    tracer = collect(sqlite_store)

    def llm(text_in, text_out):
        return tracer.start_as_current_span("LiteLLMModel.generate", attributes={
            "openinference.span.kind": "LLM", "llm.model_name": "qwen-7b",
            "llm.input_messages.0.message.role": "user", "llm.input_messages.0.message.content": text_in,
            "llm.output_messages.0.message.role": "assistant", "llm.output_messages.0.message.content": text_out})

    def tool(name, arg, out):
        return tracer.start_as_current_span(name, attributes={
            "openinference.span.kind": "TOOL", "tool.name": name, "input.value": J(arg), "output.value": out})

    def run(cls, task):
        return tracer.start_as_current_span(f"{cls}.run", attributes={
            "openinference.span.kind": "AGENT", "input.value": J({"task": task})})

    with run("CodeAgent", "population of Oslo?"):
        with tracer.start_as_current_span("Step 1", attributes={"openinference.span.kind": "CHAIN"}):
            with llm("population of Oslo?", "ask web_agent"):
                pass
            with run("ToolCallingAgent", "find Oslo population"):
                with tracer.start_as_current_span("Step 1", attributes={"openinference.span.kind": "CHAIN"}):
                    with llm("find Oslo population", "call web_search"):
                        pass
                    with tool("web_search", {"query": "Oslo population"}, "709,000"):
                        pass
        with tracer.start_as_current_span("Step 2", attributes={"openinference.span.kind": "CHAIN"}):
            with tool("final_answer", {"answer": "709,000"}, "709,000"):
                pass
    ep = only_episode(sqlite_store)
    assert [(a.agent, a.kind) for a in ep.actions] == [
        ("CodeAgent", "llm"), ("CodeAgent/ToolCallingAgent", "llm"), ("CodeAgent/ToolCallingAgent", "tool"),
        ("CodeAgent", "tool")]
    m0, w0, search, final = "CodeAgent:llm:ask web_ag", "CodeAgent/ToolCallingAgent:llm:call web_s", \
        "CodeAgent/ToolCallingAgent:tool:709,000", "CodeAgent:tool:709,000"
    assert view(ep) == [
        (m0, []),
        (w0, [m0]),  # the managed agent's first call: the manager's call before it (parentage)
        (search, sorted([m0, w0])),
        (final, [m0]),  # no call id on OpenInference tool spans: parentage, its own agent's call only
    ]


def test_genai_0_1_0_workflow_keyed_on_agent_name_and_span_links_as_edges(sqlite_store):
    """0.1.0: a workflow is an ``invoke_workflow`` span carrying ``gen_ai.agent.name`` (not an agent
    around the others); a span link from a call to an earlier one is a dependency."""
    tracer = collect(sqlite_store)

    def chat(name, text_in, text_out, links=()):
        return tracer.start_as_current_span(f"chat {name}", links=list(links), attributes={
            "gen_ai.operation.name": "chat", "gen_ai.request.model": name,
            "gen_ai.input.messages": J([user(text_in)]),
            "gen_ai.output.messages": J([{"role": "assistant", "parts": [{"type": "text", "content": text_out}]}])})

    with tracer.start_as_current_span("invoke_workflow team", attributes={
            "gen_ai.operation.name": "invoke_workflow", "gen_ai.agent.name": "team"}):
        with agent(tracer, "planner"):
            with chat("p", "plan it", "PLAN-1") as plan:
                pass
        with agent(tracer, "writer"):  # handed the plan out of band: only the link says so
            with chat("w", "write it", "DONE", links=[Link(plan.get_span_context())]):
                pass
    assert view(only_episode(sqlite_store)) == [("planner:llm:PLAN-1", []), ("writer:llm:DONE", ["planner:llm:PLAN-1"])]


def test_emitted_spans_follow_genai_0_1_0_and_carry_depends_on_as_links(sqlite_store):
    from marft_bridge.schema import Action, Episode

    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    plan = Action(id="p", agent="planner", step=1, kind="llm", output={"text": "PLAN"})
    write = Action(id="w", agent="writer", step=2, kind="llm", depends_on=["p"], output={"text": "DONE"})
    otel.SpanEmitter(tracer_provider=tp).emit(Episode(id="e1", source="team-app", task="t", actions=[plan, write]))
    spans = {s.name: s for s in mem.get_finished_spans()}
    root = spans["invoke_workflow marft"]
    assert root.attributes["gen_ai.operation.name"] == "invoke_workflow"
    assert root.attributes["gen_ai.agent.name"] == "team-app" and "gen_ai.workflow.name" not in root.attributes
    assert [ln.context.span_id for ln in spans["chat writer"].links] == [spans["chat planner"].context.span_id]
    # and a reader that knows only the links (our marft.* attributes stripped) gets the same edge back
    back = otel.spans_to_episode([_foreign(s) for s in mem.get_finished_spans()])
    assert [(a.agent, [back.action(d).agent for d in a.depends_on]) for a in back.actions] == [
        ("planner", []), ("writer", ["planner"])]


def _foreign(span):
    """The span as another producer would send it: GenAI attributes only."""
    from opentelemetry.sdk.trace import ReadableSpan

    attrs = {k: v for k, v in (span.attributes or {}).items() if not k.startswith("marft.")}
    return ReadableSpan(name=span.name, context=span.context, parent=span.parent, attributes=attrs,
                        events=span.events, links=span.links, start_time=span.start_time, end_time=span.end_time,
                        status=span.status, kind=span.kind, resource=span.resource)


def test_a_tool_span_without_a_call_id_running_an_agent_keeps_its_asking_call(sqlite_store):
    """An agent as a tool whose tool span carries no call id (matched to the asking call by tool and
    arguments): the nested agent's first call and the tool step both find the same asking call, the
    second lookup included."""
    tracer = collect(sqlite_store)
    ask = {"type": "tool_call", "id": "call-1", "name": "research", "arguments": {"q": "tides"}}

    def call(model, inputs, parts):
        return tracer.start_as_current_span("chat", attributes={
            "gen_ai.operation.name": "chat", "gen_ai.request.model": model, "gen_ai.input.messages": J(inputs),
            "gen_ai.output.messages": J([{"role": "assistant", "parts": parts}])})

    with tracer.start_as_current_span("run"):
        with agent(tracer, "boss"):
            with call("m", [user("why tides?")], [{"type": "text", "content": "thinking"}]):
                pass
            with call("m", [user("why tides?")], [ask]):
                pass
            with tracer.start_as_current_span("execute_tool research", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "research",
                    "gen_ai.tool.call.arguments": J({"q": "tides"}), "gen_ai.tool.call.result": "moon pulls"}):
                with agent(tracer, "researcher"):
                    with call("m", [user("tides")], [{"type": "text", "content": "moon?"}]):
                        pass
                    with call("m", [user("tides")], [{"type": "text", "content": "moon pulls"}]):
                        pass
    b0, b1, r0, r1 = "boss:llm:thinking", "boss:llm:", "boss/researcher:llm:moon?", "boss/researcher:llm:moon pulls"
    step = "boss:tool:moon pulls"
    got = dict(view(only_episode(sqlite_store)))
    assert got[r0] == sorted([b0, b1])  # the enclosing agent's earlier calls, the asking one among them
    assert got[step] == sorted([b1, r1])  # that same call (not "thinking", the agent's other call), and the answer


def test_parallel_agents_calling_the_same_tool_without_ids_each_keep_their_own_asking_call(sqlite_store):
    """ADK's ParallelAgent with Gemini (no call ids): both agents' model spans show ``search_0`` and
    each tool span ADK's own id. The second agent's tool ends first; each tool step still depends on
    its own agent's call (matched under the same agent span), not the earliest one in the trace."""
    tracer = collect(sqlite_store)
    ask = {"type": "tool_call", "id": "search_0", "name": "search", "arguments": {"q": "x"}}
    t = 1_000_000_000

    def span(name, parent, start, end, attrs):
        ctx = otel_trace.set_span_in_context(parent) if parent is not None else None
        s = tracer.start_span(name, context=ctx, start_time=t + start, attributes=attrs)
        return s, end

    root, _ = span("invoke_workflow", None, 0, 100, {"gen_ai.operation.name": "invoke_workflow"})
    spans = [(root, 100)]
    for who, (s0, e0, s1, e1) in {"a1": (1, 10, 20, 90), "a2": (2, 11, 21, 30)}.items():
        ag, ae = span(f"invoke_agent {who}", root, s0, 95, {"gen_ai.operation.name": "invoke_agent",
                                                             "gen_ai.agent.name": who})
        llm = span("generate_content", ag, s0, e0, {
            "gen_ai.operation.name": "generate_content", "gen_ai.request.model": "g", "gen_ai.input.messages": J(
                [user(f"{who} asks")]), "gen_ai.output.messages": J([{"role": "assistant", "parts": [ask]}])})
        tool = span("execute_tool search", ag, s1, e1, {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search", "gen_ai.tool.call.id": f"adk-{who}",
            "gen_ai.tool.call.arguments": J({"q": "x"}), "gen_ai.tool.call.result": f"found by {who}"})
        spans += [(ag, ae), llm, tool]
    for s, end in sorted(spans, key=lambda x: x[1]):  # each ends at its own time, earliest first
        s.end(end_time=t + end)
    got = dict(view(only_episode(sqlite_store)))
    assert got["a1:tool:found by a"] == ["a1:llm:"]
    assert got["a2:tool:found by a"] == ["a2:llm:"]


def test_older_events_keep_a_tool_results_non_text_blocks():
    """Strands' default events: a result's ``{"json": ...}`` block reaches the next call as JSON text."""
    from marft_bridge.integrations.otel.messages import genai_messages, legacy_messages

    result = [{"toolResult": {"toolUseId": "t1", "content": [{"json": {"temp": 72}}, {"text": " ok"}]}}]
    inputs, _ = legacy_messages([("gen_ai.tool.message", {"content": J(result)})])
    assert genai_messages(J(inputs)) == [{"role": "tool", "tool_call_id": "t1", "content": '{"json": {"temp": 72}} ok'}]
