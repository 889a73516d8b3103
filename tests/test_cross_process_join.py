"""Trace-context propagation and the callee-half join writer."""

from __future__ import annotations

import hashlib

import marft_bridge as mb
from marft_bridge.integrations.crossprocess import propagation as prop
from marft_bridge.capture.recording import EpisodeRecorder


def test_inject_extract_round_trip():
    carrier: dict = {}
    ref = prop.CallerRef("0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210", 7)
    prop.inject(carrier, ref)
    assert carrier["traceparent"] == "00-0123456789abcdef0123456789abcdef-fedcba9876543210-01"
    assert prop.extract(carrier) == ref
    # The app's own OpenTelemetry context is kept; marft's key still names the caller.
    own = {"traceparent": "00-11111111111111111111111111111111-2222222222222222-01"}
    prop.inject(own, ref)
    assert own["traceparent"].startswith("00-1111") and prop.extract(own) == ref


def test_span_ids_are_the_random_part_of_time_ordered_ids():
    assert prop.span_id("0000019a3b4c5d6e1111222233334444") == "1111222233334444"
    # Ids made within one millisecond share their time prefix; their span ids still differ.
    ids = [EpisodeRecorder.new_action_id() for _ in range(1000)]
    assert len({prop.span_id(i) for i in ids}) == len(ids)
    assert len(prop.span_id("not-hex")) == 16


def test_extract_bare_traceparent_and_garbage():
    assert prop.extract({"traceparent": "00-abcdefabcdefabcdefabcdefabcdefab-0123456789abcdef-01"}) == prop.CallerRef(
        "abcdefabcdefabcdefabcdefabcdefab")
    for bad in (None, {}, {"traceparent": "nonsense"}, {"traceparent": "00-" + "0" * 32 + "-0123456789abcdef-01"},
                {prop.CALLER_KEY: "only two"}, {prop.CALLER_KEY: "a b notanumber"}, {prop.CALLER_KEY: 5}):
        assert prop.extract(bad) is None
    # A non-hex episode id is hashed (the same id on every side of a call); a 32-hex one is kept.
    assert prop.trace_id("not-hex") == hashlib.sha256(b"not-hex").hexdigest()[:32]
    assert prop.trace_id("ab" * 16) == "ab" * 16


def _caller_half(store, step=3):
    rec = EpisodeRecorder(store, source="test")
    a = rec.record_action("caller", kind="llm", step=step, output={"text": "ask"})
    return rec, a


def test_callee_half_waits_for_the_caller_and_joins(tmp_path):
    store = mb.TraceStore.open(tmp_path / "t.db")
    caller, call_id = _caller_half(store)
    callee = prop.callee_recorder(store, prop.CallerRef(caller.id, call_id, 3), source="test", nest_under="svc")
    first = callee.record_action("svc", kind="env", step=0, output={"text": "got ask"})
    inner = callee.record_action("inner", kind="llm", step=0, output={"text": "work"})
    last = callee.record_action("svc", kind="message", depends_on=[inner], output={"text": "done"})
    callee.finish()  # written before the caller's half: the join writer waits for it
    writer = prop.join_writer(store)
    assert not writer.flush(timeout=0.3) and not store.has_episode(caller.id)
    caller.finish()
    store.flush()
    assert writer.flush(timeout=60)
    ep = store.get_episode(caller.id)
    got = {a.id: (a.agent, a.step, a.depends_on) for a in ep.actions}
    assert got == {call_id: ("caller", 3, []), first: ("svc", 4, [call_id]), inner: ("svc/inner", 4, [first]),
                   last: ("svc", 5, [inner])}
    assert ep.source == "test" and ep.status == "completed"
    store.close()


def test_unresolved_caller_is_written_without_the_edge(tmp_path):
    store = mb.TraceStore.open(tmp_path / "t.db")
    writer = prop.join_writer(store)
    writer.join_timeout = 0.2
    callee = prop.callee_recorder(store, prop.CallerRef("e" * 32, "never-written", 2), source="test")
    aid = callee.record_action("svc", kind="env", output={"text": "x"})
    callee.finish()
    assert writer.flush(timeout=60)
    ep = store.get_episode("e" * 32)
    assert [(a.id, a.step, a.depends_on) for a in ep.actions] == [(aid, 3, [])]
    assert ep.metadata["unresolved_caller"] == "never-written" and writer.unresolved == 1
    store.close()
