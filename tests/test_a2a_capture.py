"""A2A capture with real a2a-sdk servers in subprocesses on 127.0.0.1: a three-agent team whose
episode is assembled from three processes, a conversation without trace context, a malformed
message and a server that dies mid-call."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import marft_bridge as mb
from marft_bridge.integrations import a2a as cap
from marft_bridge.integrations.crossprocess import propagation as prop

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "a2a_team"
sys.path.insert(0, str(EXAMPLE))  # run.py imports the agent module's helpers by name


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"a2a_team_{name}", EXAMPLE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


team = _load("run")


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("a2a") / "team.db")
    wport, rport = team.free_port(), team.free_port()
    wurl, rurl = f"http://127.0.0.1:{wport}", f"http://127.0.0.1:{rport}"
    procs = [team.start_agent("writer", wport, path), team.start_agent("researcher", rport, path, delegate=wurl)]
    try:
        team.wait_ready(wurl, procs[0])
        team.wait_ready(rurl, procs[1])
        store = mb.TraceStore.open(path)
        yield store, wurl, rurl
        store.close()
    finally:
        for p in procs:
            team.stop(p)  # by pid, only the processes this fixture started


def wait_for(store, eid: str, n: int, timeout: float = 60):
    """The episode once the other processes' halves have arrived (n actions)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if store.has_episode(eid):
            ep = store.get_episode(eid)
            if len(ep.actions) >= n:
                return ep
        time.sleep(0.1)
    raise AssertionError(f"episode {eid} did not reach {n} actions: "
                         f"{[(a.agent, a.kind) for a in store.get_episode(eid).actions] if store.has_episode(eid) else None}")


def one(ep, agent, kind):
    (a,) = [a for a in ep.actions if a.agent == agent and a.kind == kind]
    return a


def test_team_episode_assembled_from_three_processes(agents):
    store, _, rurl = agents
    eid, answer = asyncio.run(team.ask_team(store, rurl, "why is the sky blue?"))
    store.flush()
    assert answer == "answer: researcher: FINAL: NOTES ON RESEARCH WHY IS THE SKY BLUE?"
    # Each agent sent its half back in its reply (the writer's inside the researcher's): the
    # coordinator's one write holds the whole episode, with nothing left to merge in the store.
    ep = store.get_episode(eid)
    assert len(ep.actions) == 11
    assert ep.agents == ["coordinator", "researcher", "researcher/notes", "researcher/delegate", "writer",
                         "writer/draft", "writer/polish"]
    c1, c2 = [a for a in ep.actions if a.agent == "coordinator" and a.kind == "llm"]
    m1 = one(ep, "coordinator", "message")
    r_in, r_out = one(ep, "researcher", "env"), one(ep, "researcher", "message")
    notes, m2 = one(ep, "researcher/notes", "llm"), one(ep, "researcher/delegate", "message")
    w_in, w_out = one(ep, "writer", "env"), one(ep, "writer", "message")
    draft, polish = one(ep, "writer/draft", "llm"), one(ep, "writer/polish", "llm")
    edges = {a.id: a.depends_on for a in ep.actions}
    assert edges == {
        c1.id: [], m1.id: [c1.id], c2.id: [c1.id, m1.id],
        # coordinator -> researcher: the message is the edge across processes
        r_in.id: [m1.id], notes.id: [r_in.id], m2.id: [notes.id], r_out.id: [m2.id],
        # researcher -> writer, one process further
        w_in.id: [m2.id], draft.id: [w_in.id], polish.id: [draft.id], w_out.id: [polish.id],
    }
    steps = {a.id: a.step for a in ep.actions}
    assert [steps[a.id] for a in (c1, m1, c2)] == [1, 2, 3]
    assert [steps[a.id] for a in (r_in, notes, m2, r_out)] == [3, 4, 5, 6]
    assert [steps[a.id] for a in (w_in, draft, polish, w_out)] == [6, 7, 8, 9]
    # What travelled: the message text, the reply, the receiver and the A2A ids.
    assert m1.observation.messages[0].content == "research why is the sky blue?" == r_in.output.text
    assert m1.output.text == r_out.output.text == "researcher: FINAL: NOTES ON RESEARCH WHY IS THE SKY BLUE?"
    assert m1.metadata["a2a.to"] == "researcher" and m2.metadata["a2a.to"] == "writer"
    assert m2.output.text == w_out.output.text == polish.output.text
    assert r_in.metadata["a2a.context_id"] == m1.metadata["a2a.context_id"]
    assert w_in.metadata["a2a.message_id"] == m2.metadata["a2a.message_id"]
    # Task ids are kept on both sides of each message.
    assert m1.metadata["a2a.task_id"] == r_in.metadata["a2a.task_id"] == r_out.metadata["a2a.task_id"]
    assert m2.metadata["a2a.task_id"] == w_in.metadata["a2a.task_id"] != m1.metadata["a2a.task_id"]
    assert all(a.error is None for a in ep.actions) and ep.status == "completed"
    assert ep.source == "langgraph"  # the caller's half owns the episode record


def _send(url: str, msg, instrumented: bool, agent: str = "tester"):
    from a2a.client import ClientConfig, create_client
    from a2a.types import SendMessageRequest

    async def go():
        client = await (cap.connect(url, agent=agent, client_config=ClientConfig(streaming=False)) if instrumented
                        else create_client(url, ClientConfig(streaming=False)))
        try:
            return [ev async for ev in client.send_message(SendMessageRequest(message=msg))], None
        except Exception as e:  # noqa: BLE001 - compared below
            return None, e
        finally:
            await client.close()

    return asyncio.run(go())


def _message(text: str | None = None, context_id: str = "", data=None):
    from a2a.types import Message, Part, Role
    from google.protobuf import struct_pb2

    parts = [Part(text=text)] if text is not None else []
    if data is not None:
        v = struct_pb2.Value()
        v.string_value = data
        parts.append(Part(data=v))
    return Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, context_id=context_id, parts=parts)


def _shape(events, error):
    """What the caller got, without the ids the server makes up."""
    if error is not None:
        return type(error).__name__, str(error).split(":")[0]
    out = []
    for ev in events:
        which = ev.WhichOneof("payload")
        body = getattr(ev, which)
        if which == "task":
            out.append((which, body.status.state, [p.text for p in body.status.message.parts]))
        else:
            out.append((which, [p.text for p in body.parts]))
    return out


def test_the_reply_the_app_gets_does_not_carry_the_half(agents):
    store, wurl, _ = agents
    from a2a.client import ClientConfig, create_client
    from a2a.types import SendMessageRequest

    async def go(instrumented: bool):
        cfg = ClientConfig(streaming=False)
        client = await (cap.connect(wurl, agent="asker", client_config=cfg) if instrumented
                        else create_client(wurl, cfg))
        try:
            return [ev async for ev in client.send_message(SendMessageRequest(message=_message("hi")))]
        finally:
            await client.close()

    plain = asyncio.run(go(False))
    with mb.episode(store=store) as ep:
        captured = asyncio.run(go(True))
    store.flush()
    assert [e.message.HasField("metadata") for e in plain + captured] == [False, False]
    assert [p.text for p in captured[0].message.parts] == [p.text for p in plain[0].message.parts] == ["FINAL: HI"]
    got = store.get_episode(ep.id)
    assert [(a.agent, a.kind) for a in got.actions] == [
        ("asker", "message"), ("writer", "env"), ("writer/draft", "llm"), ("writer/polish", "llm"), ("writer", "message")]


def test_conversation_without_trace_context_is_one_episode(agents):
    store, wurl, _ = agents
    ctx = "conv-" + uuid.uuid4().hex
    for text in ("first", "second"):
        events, err = _send(wurl, _message(text, ctx), instrumented=False)
        assert err is None
    eid = prop.conversation_episode_id(ctx)
    ep = wait_for(store, eid, 8)
    assert ep.source == "a2a"
    halves = [ep.actions[:4], ep.actions[4:]]
    for text, (w_in, draft, polish, w_out) in zip(("first", "second"), halves):
        assert [(a.agent, a.kind) for a in (w_in, draft, polish, w_out)] == [
            ("writer", "env"), ("writer/draft", "llm"), ("writer/polish", "llm"), ("writer", "message")]
        assert (w_in.depends_on, draft.depends_on, polish.depends_on, w_out.depends_on) == (
            [], [w_in.id], [draft.id], [polish.id])
        assert w_in.output.text == text and w_out.output.text == f"FINAL: {text.upper()}"
        assert w_in.metadata["a2a.context_id"] == ctx


def test_malformed_message_is_a_failed_step_and_the_reply_is_unchanged(agents):
    store, wurl, _ = agents
    expected = _shape(*_send(wurl, _message(None, data="not text"), instrumented=False))
    with mb.episode(store=store) as ep:
        got = _shape(*_send(wurl, _message(None, data="not text"), instrumented=True))
    store.flush()
    assert got == expected
    full = wait_for(store, ep.id, 3)
    sent = one(full, "tester", "message")
    w_in, w_out = one(full, "writer", "env"), one(full, "writer", "message")
    assert (w_in.depends_on, w_out.depends_on) == ([sent.id], [w_in.id])
    assert w_in.output.text == "" and sent.observation.messages[0].content == ""
    assert "ValueError: this agent needs a text part" in w_out.error
    assert sent.error is not None


def _dying_server():
    """A server that accepts the call, reads it, and closes the connection without answering."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()

    def serve():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)

    threading.Thread(target=serve, daemon=True).start()
    return sock


def test_server_dying_mid_call_is_recorded_and_the_error_reaches_the_caller(tmp_path):
    from agent import card

    store = mb.TraceStore.open(tmp_path / "t.db")
    sock = _dying_server()
    port = sock.getsockname()[1]
    dead = card("writer", port)
    try:
        expected = _shape(*_send(dead, _message("hello"), instrumented=False))
        with mb.episode(store=store) as ep:
            got = _shape(*_send(dead, _message("hello"), instrumented=True))
    finally:
        sock.close()
    store.flush()
    assert got == expected and isinstance(expected, tuple)  # the same exception, raised to the caller
    sent = one(store.get_episode(ep.id), "tester", "message")
    assert sent.error.startswith(expected[0]) and sent.metadata["a2a.to"] == "writer"
    assert sent.observation.messages[0].content == "hello" and sent.output.text == ""
    store.close()


def test_a_reply_held_for_the_half_is_not_delayed_by_work_after_it(tmp_path):
    """An executor that keeps working after its reply: the reply goes out alone after HOLD_S,
    and the half is written through the store instead."""
    from a2a.helpers import new_text_message

    from marft_bridge.capture.recording import EpisodeRecorder

    store = mb.TraceStore.open(tmp_path / "t.db")
    caller = EpisodeRecorder(store, source="test")
    call_id = caller.record_action("asker", kind="message", output={"text": "hi"})
    rec = prop.callee_recorder(store, prop.CallerRef(caller.id, call_id, 0), source="a2a", nest_under="writer")
    rec.store.reply = []
    sent = []

    class Queue:
        async def enqueue_event(self, event):
            sent.append(event)

    async def go():
        from marft_bridge.integrations.a2a.capture import _QueueTap
        from marft_bridge.integrations.a2a.replies import Reply

        tap = _QueueTap(Queue(), Reply(), hold=True)
        await tap.enqueue_event(new_text_message("done"))
        held = list(sent)
        await asyncio.sleep(3 * tap.HOLD_S)  # the executor still works
        rec.record_action("writer", kind="message", output={"text": "done"})
        rec.finish()
        await tap.release(rec)
        return held

    held = asyncio.run(go())
    assert held == [] and len(sent) == 1 and not sent[0].HasField("metadata")
    caller.finish()
    store.flush()
    assert prop.flush_joins(store, timeout=60)
    got = store.get_episode(caller.id)
    assert [(a.agent, a.depends_on) for a in got.actions] == [("asker", []), ("writer", [call_id])]
    store.close()


def test_a_served_agent_calling_the_openai_client_records_that_call_in_its_half(tmp_path, monkeypatch):
    """An A2A agent with no framework (one raw ``openai`` call per request, in its own process):
    its model call is an action of its half, between the request it got and its reply."""
    import os
    import subprocess

    from agent import send_text
    from fake_responses import FakeServer

    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    path = str(tmp_path / "t.db")
    store = mb.TraceStore.open(path)
    with FakeServer() as srv:
        port = team.free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, str(EXAMPLE / "agent.py"), "echo", "--port", str(port), "--store",
                                 path, "--model-url", srv.url], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            team.wait_ready(url, proc)

            async def ask():
                client = await cap.connect(url, agent="coordinator")
                try:
                    with mb.episode(store=store) as ep:
                        reply = await send_text(client, "why is the sky blue?")
                finally:
                    await client.close()
                return ep.id, reply

            eid, reply = asyncio.run(ask())
        finally:
            team.stop(proc)
    assert reply == "echo: helper says why is the sky blue?"
    got = wait_for(store, eid, 4)
    asked, got_it, model, answered = got.actions
    assert [(a.agent, a.kind) for a in got.actions] == [
        ("coordinator", "message"), ("echo", "env"), ("echo/echo-model", "llm"), ("echo", "message")]
    assert (got_it.depends_on, model.depends_on, answered.depends_on) == ([asked.id], [got_it.id], [model.id])
    assert model.output.text == "helper says why is the sky blue?"
    store.close()
