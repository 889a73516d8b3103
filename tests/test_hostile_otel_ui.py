"""Hostile input to OTel capture and to the viewer's list: looping parent ids, span metadata too deep
to parse, older per-message events with any content, ages and cursors past what a float or the
store's query holds."""

from __future__ import annotations

import json
import os
import threading

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from marft_bridge.capture import recording
from marft_bridge.integrations import otel
from marft_bridge.schema import Episode

LLM = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m"}
TRACE = 0xA11CE
ROOT, CHAT, LOOP_A, LOOP_B, SELF = 0x10, 0x11, 0x20, 0x21, 0x30


class FixedIds(IdGenerator):
    """Span ids in the order given (so a test can name a parent before its span exists)."""

    def __init__(self, span_ids):
        self.span_ids = iter(span_ids)

    def generate_span_id(self) -> int:
        return next(self.span_ids)

    def generate_trace_id(self) -> int:
        return TRACE


def under(span_id: int):
    """A context whose (local, not remote) parent is the span with this id: how a broken or hostile
    producer's parent ids reach the SDK."""
    return otel_trace.set_span_in_context(NonRecordingSpan(SpanContext(TRACE, span_id, False, TraceFlags(1))))


def run_in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)  # daemon: a hang must not keep pytest alive
    t.start()
    t.join(30)  # liveness only: the work takes milliseconds
    return t


def test_a_parent_loop_beside_a_root_neither_hangs_the_app_nor_loses_the_spans(sqlite_store):
    tp = TracerProvider(id_generator=FixedIds([ROOT, CHAT, LOOP_A, LOOP_B, SELF]))
    tp.add_span_processor(otel.EpisodeSpanProcessor(sqlite_store))
    tracer = tp.get_tracer("app")
    recording.reset_capture_stats()

    def app():
        root = tracer.start_span("invoke_workflow app", attributes={"gen_ai.operation.name": "invoke_workflow"})
        tracer.start_span("chat ok", context=otel_trace.set_span_in_context(root), attributes=LLM).end()
        # LOOP_A's parent is LOOP_B and LOOP_B's is LOOP_A; SELF is its own parent.
        tracer.start_span("chat a", context=under(LOOP_B), attributes=LLM).end()
        tracer.start_span("chat b", context=under(LOOP_A), attributes=LLM).end()
        tracer.start_span("chat self", context=under(SELF), attributes=LLM).end()
        root.end()  # the trace converts here, on the app's thread

    assert not run_in_thread(app).is_alive(), "ending the root span hung (looping parent ids)"
    sqlite_store.flush()
    (ep,) = list(sqlite_store.episodes())
    assert ep.id == format(TRACE, "032x") and sqlite_store.dead_letters() == []
    # every model call kept, the looping ones too; the loop counted once for the trace
    kept = sorted(a.metadata["span_id"] for a in ep.actions)
    assert kept == [format(i, "016x") for i in (CHAT, LOOP_A, LOOP_B, SELF)]
    assert recording.capture_stats()["by_where"] == {"otel.parent_loop": 1}
    assert "parent chain loops" in ep.metadata["last_capture_error"]


def test_a_parent_loop_with_no_root_is_dead_lettered_at_shutdown(sqlite_store):
    """The same loop with no span outside it: no episode can be made, so the trace is kept as a dead
    letter (by the exporter, when it is shut down with the trace still pending)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    mem = InMemorySpanExporter()
    tp = TracerProvider(id_generator=FixedIds([LOOP_A, LOOP_B]))
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tracer = tp.get_tracer("app")
    tracer.start_span("chat a", context=under(LOOP_B), attributes=LLM).end()
    tracer.start_span("chat b", context=under(LOOP_A), attributes=LLM).end()
    exporter = otel.EpisodeSpanExporter(sqlite_store)
    assert not run_in_thread(lambda: (exporter.export(mem.get_finished_spans()), exporter.shutdown())).is_alive()
    sqlite_store.flush()
    assert sqlite_store.count() == 0
    (dead,) = sqlite_store.dead_letters()
    assert dead.record == f"otel trace {TRACE:032x}" and "no root span" in dead.reason
    assert '"name": "chat a"' in dead.raw


def test_span_metadata_too_deep_to_parse_dead_letters_its_trace_and_the_next_is_stored(sqlite_store):
    tp = TracerProvider()
    tp.add_span_processor(otel.EpisodeSpanProcessor(sqlite_store))
    tracer = tp.get_tracer("app")
    deep = '{"a":' * 5000 + "1" + "}" * 5000  # past what json.loads reads: RecursionError
    for meta in (deep, '{"agent_name": "fine"}'):
        wf = {"gen_ai.operation.name": "invoke_workflow"}
        with tracer.start_as_current_span("invoke_workflow app", attributes=wf):
            with tracer.start_as_current_span("chat m", attributes={**LLM, "metadata": meta}) as span:
                chat_id = span.get_span_context().span_id
        if meta is deep:
            deep_trace, deep_chat = span.get_span_context().trace_id, chat_id
    sqlite_store.flush()
    (ep,) = list(sqlite_store.episodes())
    assert [a.policy.name for a in ep.actions] == ["m"]
    (dead,) = sqlite_store.dead_letters()
    assert dead.record == f"otel trace {deep_trace:032x}" and dead.field == "metadata"
    assert f"span {deep_chat:016x}" in dead.reason and "too deep" in dead.reason
    assert '"name": "chat m"' in dead.raw  # the spans, as given


# -- the viewer's list ------------------------------------------------------------------------------


def test_ui_list_answers_400_json_for_ages_cursors_and_parameters_out_of_range(sqlite_store):
    from fastapi.testclient import TestClient

    from marft_bridge.ui.app import create_app

    sqlite_store.add_episode(Episode.model_validate({
        "id": "e1", "source": "manual", "task": "t",
        "actions": [{"id": "a1", "agent": "a", "kind": "llm", "step": 1,
                     "observation": {"messages": [{"role": "user", "content": "hi"}]}, "output": {"text": "yo"}}]}))
    app = create_app(sqlite_store)
    assert app.state.index.ready.wait(60) and app.state.index.scan_error is None
    # raise_server_exceptions=False: a bug shows as the 500 a browser would get, not as a raise
    c = TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False)
    for name, value in [("since", "9" * 400 + "d"), ("until", "9" * 400 + "w"), ("since", "9" * 5000 + "d"),
                        ("reward_min", "nan")]:
        r = c.get("/api/episodes", params={name: value})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", (name, r.text[:200])
        assert r.json()["error"].startswith(name)
    r = c.get("/api/changes", params={"cursor": "-" + "9" * 400})
    assert r.status_code == 400 and "cursor" in r.json()["error"]
    for path, params in [("/api/changes", {"cursor": "abc"}), ("/api/dead-letters", {"limit": "many"})]:
        r = c.get(path, params=params)  # not an int: the viewer's 400 shape, not FastAPI's 422 {"detail"}
        assert r.status_code == 400 and r.json()["error"].startswith(next(iter(params))), r.text[:200]
    # the list still answers, and a large age that fits a float means "everything"
    assert [x["id"] for x in c.get("/api/episodes", params={"since": "9" * 300 + "d"}).json()["items"]] == ["e1"]
    assert c.get("/api/changes", params={"cursor": 0}).json()["episodes"][0]["id"] == "e1"


def test_a_span_past_the_record_limits_is_dead_lettered_beside_its_episode(tmp_path):
    """One model span with a message past ``max_field_bytes`` (2 MB by default): the episode keeps the
    other call, and the span is kept raw as a dead letter of its own (was: dropped with only a count)."""
    import json

    from marft_bridge.store import TraceStore

    with TraceStore.open(tmp_path / "t.db") as store:
        tp = TracerProvider(id_generator=FixedIds([ROOT, CHAT, SELF]))
        tp.add_span_processor(otel.EpisodeSpanProcessor(store))
        tracer = tp.get_tracer("app")
        root = tracer.start_span("invoke_workflow app", attributes={"gen_ai.operation.name": "invoke_workflow"})
        ctx = otel_trace.set_span_in_context(root)
        tracer.start_span("chat ok", context=ctx, attributes=LLM).end()
        huge = json.dumps([{"role": "user", "parts": [{"type": "text", "content": "x" * 3_000_000}]}])
        tracer.start_span("chat huge", context=ctx, attributes={**LLM, "gen_ai.input.messages": huge}).end()
        root.end()
        store.flush()
        (ep,) = list(store.episodes())
        assert [a.metadata["span_id"] for a in ep.actions] == [format(CHAT, "016x")]
        (letter,) = store.dead_letters()
        assert letter.record == f"otel trace {TRACE:032x} span {SELF:016x}"
        assert "2000000" in letter.reason.replace(",", "").replace("_", "")  # what it is past
        assert '"name": "chat huge"' in letter.raw and "xxxxxxxx" in letter.raw  # the span as it came


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
                         st.sampled_from(["text", "toolUse", "toolResult", "content", "tool_calls", "function",
                                          "name", "id", "input", "arguments", "toolUseId"]), kids, max_size=3),
                     max_leaves=8)
class FreshIds(IdGenerator):
    def generate_span_id(self) -> int:
        return int.from_bytes(os.urandom(8), "big") or 1

    def generate_trace_id(self) -> int:
        return int.from_bytes(os.urandom(16), "big") or 1


_LEGACY_EVENTS = ["gen_ai.system.message", "gen_ai.user.message", "gen_ai.assistant.message",
                  "gen_ai.tool.message", "gen_ai.choice"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(events=[("gen_ai.tool.message", "content", json.dumps([{"toolResult": {"toolUseId": "1", "content": 5}}]))],
         tool=False)  # a result whose content is not a list (lost the trace before)
@given(events=st.lists(st.tuples(st.sampled_from(_LEGACY_EVENTS), st.sampled_from(["content", "message"]),
                                 _JSON.map(json.dumps) | st.text(max_size=8) | st.integers()), max_size=4),
       tool=st.booleans())
def test_any_older_per_message_event_content_is_read_or_kept_as_text_never_lost(sqlite_store, events, tool):
    """The older GenAI per-message events (Strands' default) with any content: the episode is stored,
    no capture error (was: a tool_calls entry that is not an object lost the whole trace)."""
    recording.reset_capture_stats()
    tp = TracerProvider(id_generator=FreshIds())  # the SDK's default draws from `random`, which hypothesis seeds
    tp.add_span_processor(otel.EpisodeSpanProcessor(sqlite_store))
    tracer = tp.get_tracer("hostile")
    attrs = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "t"} if tool else LLM
    with tracer.start_as_current_span("invoke_agent a", attributes={"gen_ai.operation.name": "invoke_agent",
                                                                    "gen_ai.agent.name": "a"}):
        with tracer.start_as_current_span("step", attributes=attrs) as span:
            for name, key, value in events:
                span.add_event(name, {key: value})
    sqlite_store.flush()
    ep = sqlite_store.get_episode(format(span.get_span_context().trace_id, "032x"))
    assert [a.kind for a in ep.actions] == ["tool" if tool else "llm"]
    assert recording.capture_stats()["errors"] == 0


def test_older_events_nested_too_deep_to_parse_lose_that_spans_text_only(sqlite_store):
    """Content nested past what the JSON parser takes: the span is kept without that content, the error
    counted once (``otel.legacy_events``); the episode is stored."""
    recording.reset_capture_stats()
    tp = TracerProvider(id_generator=FreshIds())
    tp.add_span_processor(otel.EpisodeSpanProcessor(sqlite_store))
    tracer = tp.get_tracer("hostile")
    with tracer.start_as_current_span("chat", attributes=LLM) as span:
        span.add_event("gen_ai.user.message", {"content": "[" * 100_000 + "]" * 100_000})
        span.add_event("gen_ai.choice", {"message": json.dumps([{"text": "fine"}])})
    sqlite_store.flush()
    (action,) = sqlite_store.get_episode(format(span.get_span_context().trace_id, "032x")).actions
    assert action.kind == "llm" and action.output.text == ""
    assert recording.capture_stats()["by_where"] == {"otel.legacy_events": 1}
