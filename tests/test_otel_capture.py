"""OpenTelemetry: GenAI-convention and OpenInference spans -> Episodes, and our actions -> spans."""

from __future__ import annotations

import json
from typing import TypedDict

import pytest
from langgraph.graph import END, START, StateGraph
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_capture_openai import LOGPROBS, VERSIONS, server, token_model  # noqa: F401 - fixture reuse

import marft_bridge as mb
from marft_bridge.capture import recording
from marft_bridge.integrations import otel
from marft_bridge.store import TraceStore


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental")


class S(TypedDict, total=False):
    q: str
    plan: str
    code: str
    tests: str
    review: str


def team_app(url: str):
    """planner -> tidy (env) -> coder || tester -> reviewer, every model a ChatOpenAI on the local server."""
    m = {name: token_model(url, name) for name in ("planner", "coder", "tester", "reviewer")}
    g = StateGraph(S)
    g.add_node("plan", lambda s: {"plan": m["planner"].invoke(s["q"]).content}, metadata={"agent_name": "planner"})
    g.add_node("tidy", lambda s: {"plan": s["plan"].strip()})
    g.add_node("code", lambda s: {"code": m["coder"].invoke(s["plan"]).content}, metadata={"agent_name": "coder"})
    g.add_node("test", lambda s: {"tests": m["tester"].invoke(s["plan"]).content}, metadata={"agent_name": "tester"})
    g.add_node("review", lambda s: {"review": m["reviewer"].invoke(s["code"] + " | " + s["tests"]).content},
               metadata={"agent_name": "reviewer"})
    g.add_edge(START, "plan")
    g.add_edge("plan", "tidy")
    g.add_edge("tidy", "code")
    g.add_edge("tidy", "test")
    g.add_edge(["code", "test"], "review")
    g.add_edge("review", END)
    return g.compile()


def llm_view(ep):
    """Per llm action: (agent, input text, output text, model, llm actions it depends on through env steps)."""
    by_id = {a.id: a for a in ep.actions}

    def llm_deps(ids):
        out = set()
        for d in ids:
            a = by_id[d]
            out |= {a.agent} if a.kind == "llm" else llm_deps(a.depends_on)
        return out

    return sorted(
        (a.agent, a.observation.messages[-1].content, a.output.text, a.policy.name, tuple(sorted(llm_deps(a.depends_on))))
        for a in ep.actions if a.kind == "llm"
    )


def native_episode(url, store):
    app = mb.instrument(team_app(url), store=store)
    app.invoke({"q": "what?"})
    store.flush()
    return store.get_episode(app.last_episode_id)


EXPECTED = [
    ("coder", "planner answer to what?", "coder answer to planner answer to what?", "coder", ("planner",)),
    ("planner", "what?", "planner answer to what?", "planner", ()),
    ("reviewer", "coder answer to planner answer to what? | tester answer to planner answer to what?",
     "reviewer answer to coder answer to planner answer to what? | tester answer to planner answer to what?",
     "reviewer", ("coder", "planner", "tester")),
    ("tester", "planner answer to what?", "tester answer to planner answer to what?", "tester", ("planner",)),
]


def provider_with(store):
    tp = TracerProvider()
    proc = otel.EpisodeSpanProcessor(store)
    tp.add_span_processor(proc)
    return tp, proc


def test_official_genai_langchain_instrumentation_converts_to_equivalent_episode(
        server, sqlite_store, tmp_path):  # noqa: F811
    _, url = server
    native = native_episode(url, TraceStore.open(tmp_path / "native.db"))
    assert llm_view(native) == EXPECTED

    from opentelemetry.instrumentation.genai.langchain import LangChainInstrumentor

    tp, proc = provider_with(sqlite_store)
    inst = LangChainInstrumentor()
    inst.instrument(tracer_provider=tp, skip_dep_check=True)
    try:
        team_app(url).invoke({"q": "what?"})
    finally:
        inst.uninstrument()
    sqlite_store.flush()
    (ep,) = list(sqlite_store.episodes())
    assert ep.source == "otel" and ep.task == {"q": "what?"} and proc.assembler.episodes == 1
    assert llm_view(ep) == llm_view(native)
    planner = next(a for a in ep.actions if a.agent == "planner")
    assert planner.sampling.model_dump(exclude_none=True) == {"temperature": 0.5, "max_tokens": 16}
    assert planner.token_source == "retokenize"  # GenAI spans carry no token ids
    steps = {a.agent: a.step for a in ep.actions}
    assert steps["planner"] < steps["coder"] == steps["tester"] < steps["reviewer"]


def test_openinference_instrumentation_converts_to_equivalent_episode(server, sqlite_store, tmp_path):  # noqa: F811
    _, url = server
    native = native_episode(url, TraceStore.open(tmp_path / "native.db"))

    from openinference.instrumentation.langchain import LangChainInstrumentor

    tp, _ = provider_with(sqlite_store)
    inst = LangChainInstrumentor()
    inst.instrument(tracer_provider=tp)
    try:
        team_app(url).invoke({"q": "what?"})
    finally:
        inst.uninstrument()
    sqlite_store.flush()
    (ep,) = list(sqlite_store.episodes())
    assert llm_view(ep) == llm_view(native) == EXPECTED
    # OpenInference shows every node, so env steps and LangGraph supersteps match the native capture too
    assert sorted((a.agent, a.kind, a.step) for a in ep.actions) == sorted(
        (a.agent, a.kind, a.step) for a in native.actions)
    coder = next(a for a in ep.actions if a.agent == "coder")
    assert coder.sampling.model_dump(exclude_none=True) == {"temperature": 0.5, "top_k": 20, "max_tokens": 16}


def test_emitted_spans_round_trip_exactly(server, sqlite_store):  # noqa: F811
    _, url = server
    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    emitter = otel.SpanEmitter(tracer_provider=tp).instrument()
    try:
        native = native_episode(url, sqlite_store)
    finally:
        emitter.uninstrument()
    spans = mem.get_finished_spans()
    assert sorted(s.name for s in spans) == sorted(
        ["invoke_workflow marft", "chat planner", "chat coder", "chat tester", "chat reviewer", "invoke_agent tidy"])
    chat = next(s for s in spans if s.name == "chat coder")
    assert chat.attributes["gen_ai.operation.name"] == "chat" and chat.attributes["gen_ai.agent.name"] == "coder"
    assert list(chat.attributes["marft.output.logprobs"]) == LOGPROBS
    assert chat.attributes["marft.policy.version"] == VERSIONS["coder"]
    tidy = next(s for s in spans if s.name == "invoke_agent tidy")
    assert [link.context.span_id for link in chat.links] == [tidy.context.span_id]

    back = otel.spans_to_episode(spans)
    assert back.id == native.id and back.task == native.task
    strip = lambda a: a.model_dump(exclude={"metadata"})  # noqa: E731
    assert [strip(a) for a in back.actions] == [strip(a) for a in native.actions]


def test_own_spans_are_not_recorded_twice(server, sqlite_store):  # noqa: F811
    _, url = server
    tp, proc = provider_with(sqlite_store)
    emitter = otel.SpanEmitter(tracer_provider=tp).instrument()
    try:
        native_episode(url, sqlite_store)
    finally:
        emitter.uninstrument()
    sqlite_store.flush()
    assert sqlite_store.count() == 1 and proc.assembler.episodes == 0


@pytest.mark.parametrize("where", ["attributes", "event"])
def test_hand_made_genai_spans_tools_parentage_and_message_flow(sqlite_store, where):
    """``where``: the messages as span attributes, or on the semantic conventions' operation-details
    event (what an instrumentation capturing content as events only emits)."""
    tp, proc = provider_with(sqlite_store)
    tracer = tp.get_tracer("app")

    def msgs(role, text):
        return json.dumps([{"role": role, "parts": [{"type": "text", "content": text}]}])

    class Chat:
        def __init__(self, name, attributes):
            content = {k: attributes.pop(k) for k in list(attributes) if k.startswith("gen_ai.") and "messages" in k}
            self.span = tracer.start_as_current_span(name, attributes={**attributes, **(
                content if where == "attributes" else {})})
            self.event = content if where == "event" else None

        def __enter__(self):
            span = self.span.__enter__()
            if self.event is not None:
                span.add_event("gen_ai.client.inference.operation.details", attributes=self.event)
            return span

        def __exit__(self, *exc):
            return self.span.__exit__(*exc)

    with tracer.start_as_current_span("invoke_workflow app", attributes={"gen_ai.operation.name": "invoke_workflow",
                                                                         "gen_ai.input.messages": msgs("user", "task")}):
        with tracer.start_as_current_span("invoke_agent lead", attributes={"gen_ai.operation.name": "invoke_agent",
                                                                           "gen_ai.agent.name": "lead"}):
            with Chat("chat lead-model", {
                    "gen_ai.operation.name": "chat", "gen_ai.request.model": "lead", "gen_ai.request.temperature": 0.7,
                    "gen_ai.input.messages": msgs("user", "task"), "gen_ai.output.messages": msgs("assistant", "search cats")}):
                pass
            with tracer.start_as_current_span("execute_tool search", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search",
                    "gen_ai.tool.call.arguments": '{"q": "cats"}', "gen_ai.tool.call.result": "cats are mammals"}):
                pass
        with tracer.start_as_current_span("invoke_agent writer", attributes={"gen_ai.operation.name": "invoke_agent",
                                                                             "gen_ai.agent.name": "writer"}):
            with Chat("chat writer", {
                    "gen_ai.operation.name": "chat", "gen_ai.request.model": "writer",
                    "gen_ai.input.messages": msgs("user", "facts: cats are mammals"),
                    "gen_ai.output.messages": msgs("assistant", "Cats are mammals.")}):
                pass
        with tracer.start_as_current_span("chat", attributes={"gen_ai.operation.name": "chat",
                                                               "gen_ai.request.model": "judge",
                                                               "gen_ai.input.messages": "not json"}):
            pass
    sqlite_store.flush()
    (ep,) = list(sqlite_store.episodes())
    view = [(a.agent, a.kind, a.step, sorted(ep.action(d).agent + ":" + ep.action(d).kind for d in a.depends_on))
            for a in ep.actions]
    assert view == [
        ("lead", "llm", 1, []),
        ("lead", "tool", 2, ["lead:llm"]),  # parentage: same agent span
        ("writer", "llm", 3, ["lead:tool"]),  # message flow: the tool result is in its prompt
        ("judge", "llm", 1, []),  # unreadable messages: recorded, nothing invented
    ]
    assert ep.actions[0].sampling.temperature == 0.7 and ep.task == "task"
    assert ep.actions[1].output.text == "cats are mammals" and ep.actions[1].metadata["span_id"]


def test_traces_without_model_calls_are_skipped_and_bad_spans_counted(sqlite_store):
    tp, proc = provider_with(sqlite_store)
    tracer = tp.get_tracer("app")
    with tracer.start_as_current_span("GET /health"):
        pass
    recording.reset_capture_stats()
    with tracer.start_as_current_span("root"):
        with tracer.start_as_current_span("chat", attributes={"gen_ai.operation.name": "chat",
                                                               "gen_ai.request.temperature": -3.0}):
            pass  # an invalid temperature: that action is refused, the trace still converts
        with tracer.start_as_current_span("chat ok", attributes={"gen_ai.operation.name": "chat",
                                                                  "gen_ai.request.model": "m"}):
            pass
    sqlite_store.flush()
    (ep,) = list(sqlite_store.episodes())
    assert [a.policy.name for a in ep.actions] == ["m"]
    assert recording.capture_stats()["by_where"] == {"otel.span": 1}


def test_exporter_with_batches(sqlite_store):
    exporter = otel.EpisodeSpanExporter(sqlite_store)
    tp = TracerProvider()
    mem = InMemorySpanExporter()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tracer = tp.get_tracer("app")
    with tracer.start_as_current_span("root"):
        with tracer.start_as_current_span("chat", attributes={"gen_ai.operation.name": "chat",
                                                               "gen_ai.request.model": "m"}):
            pass
    spans = list(mem.get_finished_spans())
    exporter.export(spans[:1])  # the child first: nothing yet
    sqlite_store.flush()
    assert sqlite_store.count() == 0
    exporter.export(spans[1:])
    sqlite_store.flush()
    assert sqlite_store.count() == 1


def test_tool_calling_episode_round_trips_through_emitted_spans(sqlite_store):
    """Tools offered, tool calls (exact argument strings), tool steps and tool messages survive
    our spans -> Episode."""
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.",
                                               "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2}'}}
    from marft_bridge.schema import utcnow

    rec = recording.EpisodeRecorder(sqlite_store, task="add")
    ask = rec.record_action("calc", started_at=utcnow(), observation={"messages": [{"role": "user", "content": "add"}], "tools": tools,
                                                 "tool_choice": "required"},
                            output={"text": "", "tool_calls": [call], "finish_reason": "tool_calls"}, policy={"name": "calc"})
    tool = rec.record_action("calc", kind="tool", depends_on=[ask], output={"text": "2"}, started_at=utcnow(),
                             observation={"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]},
                             metadata={"tool.name": "add", "tool_call_id": "call_1"})
    rec.record_action("calc", depends_on=[ask, tool], policy={"name": "calc"}, output={"text": "2."}, started_at=utcnow(),
                      observation={"messages": [{"role": "user", "content": "add"},
                                                {"role": "assistant", "content": None, "tool_calls": [call]},
                                                {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "2"}],
                                   "tools": tools})
    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    emitter = otel.SpanEmitter(tracer_provider=tp).instrument()
    try:
        native = rec.finish() and rec.episode
    finally:
        emitter.uninstrument()
    spans = mem.get_finished_spans()
    tool_span = next(s for s in spans if s.name == "execute_tool calc")
    assert tool_span.attributes["gen_ai.tool.call.id"] == "call_1" and tool_span.attributes["gen_ai.tool.name"] == "add"
    back = otel.spans_to_episode(spans)
    strip = lambda a: a.model_dump(exclude={"metadata"})  # noqa: E731
    assert [strip(a) for a in back.actions] == [strip(a) for a in native.actions]


def test_genai_team_under_a_supervisor_span_gets_exact_edges(sqlite_store):
    """A supervisor agent span enclosing three sub-agents (newest GenAI conventions, by hand): a
    sub-agent depends on the supervisor's calls, not on a sibling's; a critic handed the
    researcher's history depends on the call that emitted the tool call in it and the tool step
    that answered it; a JSON output passed on compact is still found; a failed tool span says
    what it raised; the finish reason is read off the output message."""
    from opentelemetry.trace import Status, StatusCode

    tp, _ = provider_with(sqlite_store)
    tracer = tp.get_tracer("app")
    J = json.dumps

    def chat(model, inp, out, finish="stop"):
        with tracer.start_as_current_span(f"chat {model}", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.request.model": model, "gen_ai.input.messages": J(inp),
                "gen_ai.output.messages": J([{"role": "assistant", "parts": out, "finish_reason": finish}])}):
            pass

    def agent(name):
        return tracer.start_as_current_span(f"invoke_agent {name}", attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": name})

    def user(text):
        return {"role": "user", "parts": [{"type": "text", "content": text}]}

    call = {"type": "tool_call", "id": "call_1", "name": "search", "arguments": {"q": "tides"}}
    answer = {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1", "response": "moon pulls tides"}]}
    with tracer.start_as_current_span("invoke_workflow team", attributes={"gen_ai.operation.name": "invoke_workflow"}):
        with agent("supervisor"):
            chat("sup", [user("go")], [{"type": "text", "content": "ROUTE-ALL"}])
            with agent("researcher"):
                chat("res", [user("tides")], [call], finish="tool_call")
                with tracer.start_as_current_span("execute_tool search", attributes={
                        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search",
                        "gen_ai.tool.call.id": "call_1", "gen_ai.tool.call.result": "moon pulls tides"}):
                    pass
                chat("res", [user("tides"), {"role": "assistant", "parts": [call]}, answer],
                     [{"type": "text", "content": '{"fact": "moon pulls tides", "score": 7}'}])
            with agent("stylist"):
                chat("sty", [user("pick a style")], [{"type": "text", "content": "STYLE-Q"}])
                with tracer.start_as_current_span("execute_tool lint", attributes={
                        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lint"}) as failing:
                    failing.record_exception(ValueError("no such style"))
                    failing.set_status(Status(StatusCode.ERROR))
            with agent("critic"):  # handed the researcher's history and its answer, compact
                chat("cri", [user("tides"), {"role": "assistant", "parts": [call]}, answer,
                             user('check {"fact":"moon pulls tides","score":7}')], [{"type": "text", "content": "OK"}])
    sqlite_store.flush()
    (ep,) = list(sqlite_store.episodes())
    names = {a.id: f"{a.agent.rsplit('/', 1)[-1]}:{a.kind}:{a.output.text[:8]}" for a in ep.actions}
    assert [(names[a.id], sorted(names[d] for d in a.depends_on)) for a in ep.actions] == [
        ("supervisor:llm:ROUTE-AL", []),
        ("researcher:llm:", ["supervisor:llm:ROUTE-AL"]),
        ("researcher:tool:moon pul", ["researcher:llm:"]),  # the call that asked, by gen_ai.tool.call.id
        ("researcher:llm:{\"fact\":", ["researcher:llm:", "researcher:tool:moon pul", "supervisor:llm:ROUTE-AL"]),
        ("stylist:llm:STYLE-Q", ["supervisor:llm:ROUTE-AL"]),  # not the sibling researcher's
        ("stylist:tool:", ["stylist:llm:STYLE-Q", "supervisor:llm:ROUTE-AL"]),  # no call id: parentage
        ("critic:llm:OK", ["researcher:llm:", "researcher:llm:{\"fact\":", "researcher:tool:moon pul",
                           "supervisor:llm:ROUTE-AL"]),
    ]
    assert ep.actions[5].error == "ValueError: no such style"
    assert [ep.actions[i].output.finish_reason for i in (1, 3)] == ["tool_call", "stop"]
