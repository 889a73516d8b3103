"""Capture A2A agents (a2a-sdk 1.x, protocol 1.0): a client interceptor and an executor wrapper.

Every A2A agent is an agent of the episode, named by its ``AgentCard``.

Client: ``CaptureInterceptor(agent=None)`` (pass it to ``create_client(..., interceptors=[...])``)
or ``await connect(url_or_card, agent=..., ...)`` / ``instrument_client(client, agent=...)``,
which also records calls that fail in the transport (``uninstrument_client(client)`` undoes it).
Inside an episode each ``send_message`` is
a ``kind="message"`` action of the sending agent (``agent``; inside an A2A agent served with
``CaptureExecutor``: that agent): the text sent (``observation``), the reply (``output``: the
reply message, or the task's status message and artifacts), and in ``metadata`` the receiver
(``a2a.to``), ``a2a.task_id``, ``a2a.context_id``, ``a2a.state``, ``latency_s``. It depends on
the sender's latest model call (inside a LangGraph node: on the node's inputs), and the sender's
next model call depends on it. The message carries the trace context in ``Message.metadata``
(``traceparent`` + ``marft/caller``).

Server: ``CaptureExecutor(executor, card, store=None)`` wraps an ``AgentExecutor``. Each request
becomes the receiving agent's half of the caller's episode (see ``integrations.propagation``): an
``env`` action with the message received (depending on the caller's message action: the
agent-to-agent edge), whatever the agent records while it works (model calls of a LangGraph app
inside it, named ``"<agent>/<node>"``, with their own dependencies; messages it sends to further
agents), and a ``message`` action with its reply. A request without trace context joins the
episode of its A2A ``context_id`` (one conversation, one episode; ids ``conversation_episode_id``).
An instrumented client asks for the half in the reply (``marft/half``): when the agent replies
with a ``Message``, the reply is sent once the request is recorded, with the half in its metadata,
which the client removes and records into its own episode (one write per episode, no merge in
the store). Task replies, failed requests and clients that did not ask go through the store.

Capture never changes what the protocol returns: a malformed message, an executor that raises
and a server that dies mid-call are recorded as failed steps (``error``), and the caller gets
what it would have got anyway.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from dataclasses import dataclass, field
from typing import Any

from a2a.client import create_client
from a2a.client.interceptors import ClientCallInterceptor
from a2a.server.agent_execution import AgentExecutor

from ...capture_errors import capture_error, guarded
from ...capture.episode_context import current_episode
from ...errors import MarftError
from ...schema import utcnow
from .. import openai as oa
from ..crossprocess import propagation as prop
from .replies import Reply, message_metadata, message_text
from ...seams import EpisodeSink

# The agent a served request belongs to: messages it sends on are that agent's actions.
_SERVING: contextvars.ContextVar[str | None] = contextvars.ContextVar("marft_a2a_serving", default=None)
_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("marft_a2a_call", default=None)

_SEND_METHODS = ("send_message", "send_message_streaming")


# -- client --------------------------------------------------------------------------------------


@dataclass
class _Call:
    step: prop.CallStep
    agent: str | None
    to: str
    sent: str
    message_id: str
    started: Any
    t0: float
    reply: Reply = field(default_factory=Reply)
    done: bool = False

    def record(self, error: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        with guarded("a2a.message_step", self.step.recorder):
            r = self.reply
            if error is None:
                error = r.failure()
            meta = {"a2a.to": self.to, "a2a.message_id": self.message_id, **r.meta(),
                    "latency_s": time.perf_counter() - self.t0}
            who = self.step.agent or self.agent or "a2a_client"
            text = r.text
            self.step.record(who, "message", started_at=self.started, error=error, metadata=meta,
                             observation={"messages": [{"role": "user", "content": self.sent}]},
                             output={"text": text}, validate=prop.needs_validation(who, self.sent, text, error))


class CaptureInterceptor(ClientCallInterceptor):
    """A2A ``ClientCallInterceptor`` that records each message sent (see the module docstring)."""

    def __init__(self, agent: str | None = None):
        self.agent = agent
        prop.CALLS.instrument(self)  # the call steps it makes are found by callees served here

    async def before(self, args: Any) -> None:
        if args.method not in _SEND_METHODS:
            return
        rec = current_episode()
        if rec is None:
            return
        with guarded("a2a.before", rec):
            agent = self.agent or _SERVING.get()
            step = prop.begin_call(rec, agent)
            msg = args.input.message
            carrier: dict[str, Any] = {}
            prop.inject(carrier, step.ref)
            carrier[prop.HALF_KEY] = "reply"  # a captured agent sends its half back: no merge in the store
            msg.metadata.update(carrier)
            _CALL.set(_Call(step, agent, args.agent_card.name, message_text(msg), msg.message_id, utcnow(),
                            time.perf_counter()))

    async def after(self, args: Any) -> None:
        if args.method not in _SEND_METHODS:
            return
        call = _CALL.get()
        if call is None or call.done:
            return
        with guarded("a2a.after", call.step.recorder):
            half = _take_reply_half(args.result)
            if half is not None and not prop.accept_reply_half(call.step, half):
                capture_error("a2a.reply_half", ValueError("the agent's half in the reply is not of this call"))
            call.reply.add(args.result)
            if call.reply.final:
                call.record()


def _take_reply_half(result: Any) -> Any:
    """Take the agent's half out of a reply message's metadata (the app gets the reply an agent
    without capture sends); None when there is none."""
    which = result.WhichOneof("payload") if type(result).__name__ in ("StreamResponse", "SendMessageResponse") else None
    if which != "message":
        return None
    msg = result.message
    if not msg.HasField("metadata") or prop.HALF_KEY not in msg.metadata.fields:
        return None
    raw = msg.metadata[prop.HALF_KEY]
    del msg.metadata[prop.HALF_KEY]
    if not msg.metadata.fields:
        msg.ClearField("metadata")
    return raw if isinstance(raw, str) else None


def instrument_client(client: Any, agent: str | None = None) -> Any:
    """Add a ``CaptureInterceptor`` to an a2a ``Client`` and record calls that fail in the transport."""
    if getattr(client, "_marft_a2a", None) is not None:
        return client
    interceptors = getattr(client, "_interceptors", None)
    if not isinstance(interceptors, list):
        raise MarftError(f"cannot add an interceptor to {type(client).__name__}; create the client with "
                         "marft_bridge.integrations.a2a.connect(...) or pass CaptureInterceptor() to create_client")
    if not any(isinstance(i, CaptureInterceptor) for i in interceptors):
        interceptors.append(CaptureInterceptor(agent))
    orig = client.send_message

    async def send_message(request: Any, *args: Any, **kw: Any) -> Any:
        _CALL.set(None)
        try:
            async for event in orig(request, *args, **kw):
                yield event
        except GeneratorExit:
            raise
        except BaseException as e:
            call = _CALL.get()
            if call is not None and not call.done:
                call.record(f"{type(e).__name__}: {e}")
            raise
        finally:
            call = _CALL.get()
            if call is not None and not call.done:
                # The caller stopped reading before a final event: record what arrived.
                call.record(None if call.reply.texts else "no final reply received")

    client.send_message = send_message
    client._marft_a2a = orig
    return client


def uninstrument_client(client: Any) -> Any:
    """Undo ``instrument_client``: the client's own ``send_message`` and interceptors again."""
    if getattr(client, "_marft_a2a", None) is None:
        return client
    client.__dict__.pop("send_message", None)
    interceptors = getattr(client, "_interceptors", None)
    if isinstance(interceptors, list):
        gone = [i for i in interceptors if isinstance(i, CaptureInterceptor)]
        interceptors[:] = [i for i in interceptors if not isinstance(i, CaptureInterceptor)]
        for i in gone:
            prop.CALLS.uninstrument(i)
    client._marft_a2a = None
    return client


async def connect(agent_or_url: Any, agent: str | None = None, client_config: Any = None,
                  interceptors: list | None = None, **kw: Any) -> Any:
    """``a2a.client.create_client`` with capture installed (``instrument_client``)."""
    icpt = [*(interceptors or []), CaptureInterceptor(agent)]
    return instrument_client(await create_client(agent_or_url, client_config, interceptors=icpt, **kw), agent)


# -- server --------------------------------------------------------------------------------------


class _QueueTap:
    """The executor's event queue, seeing what the agent publishes (everything else passes through).

    When the caller asked for this agent's half in the reply, a reply ``Message`` is held until
    the request is recorded, then sent with the half in its metadata (``release``). An executor
    that keeps working after its reply does not delay it: past ``HOLD_S`` the message goes alone
    and the half through the store."""

    HOLD_S = 0.1

    def __init__(self, queue: Any, reply: Reply, hold: bool = False):
        self._queue = queue
        self._reply = reply
        self._hold = hold
        self._held: Any = None
        self._timer: Any = None
        self._late: Any = None  # the task sending a message held too long

    async def enqueue_event(self, event: Any) -> None:
        with guarded("a2a.server.event"):
            self._reply.add(event)
        await self._send_held()  # anything after a held message goes after it
        if self._hold and type(event).__name__ == "Message":
            self._held = event
            self._timer = asyncio.get_running_loop().call_later(self.HOLD_S, self._expire)
            return
        await self._queue.enqueue_event(event)

    def _expire(self) -> None:
        self._late = asyncio.get_running_loop().create_task(self._send_held())

    async def _send_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            await self._queue.enqueue_event(held)

    async def release(self, rec: Any) -> None:
        """Send the held message, with the finished half of ``rec`` when there is one; a half no
        message can carry goes to the join writer."""
        if self._timer is not None:
            self._timer.cancel()
        if self._late is not None:
            await self._late
        held, self._held = self._held, None
        with guarded("a2a.server.reply_half", rec):
            half = prop.reply_half(rec)
            if half is not None:
                if held is not None:
                    held.metadata[prop.HALF_KEY] = half
                else:
                    prop.write_reply_half(rec, half)
        if held is not None:
            await self._queue.enqueue_event(held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


class CaptureExecutor(AgentExecutor):
    """Wraps an ``AgentExecutor``: each request is recorded as this agent's half of the episode."""

    def __init__(self, executor: Any, card: Any, store: EpisodeSink | None = None):
        self.executor = executor
        self.agent = card if isinstance(card, str) else card.name
        self.store = store
        prop.CALLS.instrument(self)

    async def cancel(self, context: Any, event_queue: Any) -> None:
        await self.executor.cancel(context, event_queue)

    async def execute(self, context: Any, event_queue: Any) -> None:
        rec = None
        with guarded("a2a.server.open"):
            rec = self._open(context)
        if rec is None:
            return await self.executor.execute(context, event_queue)
        reply = Reply()
        tap = _QueueTap(event_queue, reply, hold=rec.store.reply is not None)
        token = _SERVING.set(self.agent)
        oa.OPENAI.instrument(rec)  # while it serves: the model calls the agent makes are its half's actions
        try:
            with rec.activate():
                await self.executor.execute(context, tap)
        except BaseException as e:
            _SERVING.reset(token)
            self._close(rec, context, reply, f"{type(e).__name__}: {e}")
            with guarded("a2a.server.reply_half", rec):
                prop.write_reply_half(rec, None)  # not sent back with a failed request
            await tap.release(rec)
            raise
        finally:
            oa.OPENAI.uninstrument(rec)
        _SERVING.reset(token)
        self._close(rec, context, reply, None)
        await tap.release(rec)  # the reply, with this agent's half when the caller asked for it

    def _open(self, context: Any) -> Any:
        msg = context.message
        carrier = message_metadata(msg)
        caller = prop.extract(carrier) or prop.extract(context.metadata)
        eid = None
        if caller is None:
            eid = prop.conversation_episode_id(context.context_id or "")
        rec = prop.callee_recorder(self.store, caller, episode_id=eid, source="a2a",
                                   metadata={"a2a.context_id": context.context_id}, nest_under=self.agent)
        if caller is not None and caller.action_id and carrier.get(prop.HALF_KEY) == "reply":
            rec.store.reply = []  # the half goes back in the reply message (``_QueueTap.release``)
        text, err = "", None
        if msg is None:
            err = "request has no message"
        else:
            text = message_text(msg)
            if not text and not len(msg.parts):
                err = "message has no parts"
        meta = {"a2a.task_id": context.task_id, "a2a.context_id": context.context_id,
                "a2a.message_id": msg.message_id if msg is not None else None}
        # Absolute steps from the start: messages this agent sends on carry their step onwards.
        step = caller.step + 1 if caller is not None and caller.action_id else 0
        rec.record_action(self.agent, kind="env", step=step, output={"text": text}, error=err,
                          metadata={k: v for k, v in meta.items() if v},
                          validate=prop.needs_validation(self.agent, text))
        return rec

    def _close(self, rec: Any, context: Any, reply: Reply, error: str | None) -> None:
        with guarded("a2a.server.close", rec):
            if error is None:
                error = reply.failure()
            acts = prop.recorded(rec)
            used = {d for a in acts for d in a[4]}
            # The first action (the message received) starts everything else in the half.
            leaves = [a[3] for a in acts[1:] if a[3] not in used] or [acts[0][3]]
            text = reply.text
            step = max(a[2] for a in acts) + 1  # after its own actions (not those of agents it called)
            rec.record_action(self.agent, kind="message", step=step, depends_on=leaves, output={"text": text},
                              error=error, metadata={"a2a.context_id": context.context_id, **reply.meta()},
                              validate=prop.needs_validation(self.agent, text, error))
            rec.finish("failed" if error else "completed", error)


__all__ = ["CaptureExecutor", "CaptureInterceptor", "connect", "instrument_client", "uninstrument_client"]
