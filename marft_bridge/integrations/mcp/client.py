"""Capture MCP tool use (python SDK ``mcp``, 1.x from 1.21.2 and 2.x: ``SUPPORTED``) on the client and
on the server (``mcp_server``: ``instrument_server``, re-exported here).

Client, one object: ``instrument_client(client, agent=None, store=None)`` wraps one 2.x ``mcp.Client``
or one ``ClientSession`` (1.x, or a 2.x ``client.session``; what ``langchain-mcp-adapters``'
``load_mcp_tools(session)`` calls). Client, every session: ``instrument()`` hooks
``ClientSession.call_tool`` (and ``initialize``, for the server's name) process-wide, for sessions
the app never hands out (``MultiServerMCPClient`` opens one per tool call); ``uninstrument()``
restores them. Both are idempotent.

Inside an episode (``marft_bridge.episode(...)`` or a captured LangGraph run) every ``call_tool`` is
one ``kind="tool"`` action (an environment step, not trained): the tool name and arguments (in
``observation`` and ``metadata``: ``mcp.tool``, ``mcp.arguments``), ``mcp.server`` (the server's
name where the session knows it), ``mcp.session`` (an id per client session), the result text or
the error, ``metadata["latency_s"]``. Whose step, on what it depends:
- the call runs inside a captured tool step (a LangChain tool run: ``langchain-mcp-adapters``, or
  any tool calling MCP; an OpenAI Agents SDK function tool): it *is* that step: the ``mcp.*``
  details enrich it, nothing is recorded twice, and the step stays the agent's whose model call
  asked for the tool;
- a LangGraph node calls ``call_tool`` for a tool call a model call asked for (matched by name and
  arguments): that model call's agent, depending on that call;
- elsewhere in a LangGraph node: the node's agent, depending on the node's inputs;
- outside LangGraph, for a tool call a recorded model call of the episode asked for (a raw
  client's loop; matched by name and arguments, not answered yet): that call's agent, depending on
  it, answering its ``tool_call_id``;
- else outside LangGraph: ``agent`` (default: the latest model call's agent), depending on the
  latest ``llm`` action of ``agent``, or of anyone.
The agent's next model call depends on it (LangGraph data flow, or the tool result appearing in the
next prompt). The client's ``sampling_callback`` (the server asking the client's model; set up by
``instrument_client``) is recorded as an ``llm`` action of the step's agent; the tool step then
depends on it. Outside an episode nothing is recorded.

Capture never changes what a call returns or raises: an MCP error result, an exception or a
server that dies mid-call is recorded as a failed step (``error``) and then returned / raised as
it would have been. Outside ``SUPPORTED`` the hooks are not applied (logged once); nothing breaks.
"""

from __future__ import annotations

import contextvars
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...capture_errors import capture_error, guarded
from ...capture.episode_context import CaptureState, Instrumentor, current_episode
from ...schema import utcnow
from .. import openai as oa
from ..crossprocess import propagation as prop
from ..hooks import Hooks, arg, installed_version
from .records import block_text, error_text, input_required, jsonable, result_text, tool_fields
from .server import CaptureMiddleware, instrument_server, uninstrument_server
from .. import checked_range
from ...seams import EpisodeSink

# mcp versions the client hooks were checked against: [low, high). call_tool(meta=...) came in 1.19;
# 1.21.2 is the first 1.x that imports on pydantic 2.14.
SUPPORTED = checked_range("mcp")  # the range in integrations.INTEGRATIONS

# The captured tool call running in this context (per call: the rounds of a captured 2.x
# ``Client.call_tool`` pass through the session hooks, and the sampling callback finds its call).
_CALL: contextvars.ContextVar[_ToolCall | None] = contextvars.ContextVar("marft_mcp_call", default=None)


@dataclass
class _ToolCall:
    step: prop.CallStep
    sampled: list[str] = field(default_factory=list)


def _server_name(target: Any) -> str | None:
    try:
        info = getattr(target, "server_info", None)  # 2.x Client and ClientSession
    except Exception:  # noqa: BLE001 - not connected yet
        info = None
    if info is not None:
        return getattr(info, "name", None)
    session = getattr(target, "session", None) if not hasattr(target, "send_request") else target
    return getattr(session, "__dict__", {}).get("_marft_server") if session is not None else None


def _half_server(step: prop.CallStep) -> str | None:
    """The server's name as its captured half says it (a 1.x session instrumented after ``initialize``)."""
    for data, _, _ in step.halves:
        name = (data.get("metadata") or {}).get("mcp.server") if isinstance(data, dict) else None
        if isinstance(name, str):
            return name
    return None


def _session_id(target: Any) -> str | None:
    """An id per client session (the SDK exposes none on the client): the steps of one session share it."""
    session = target if hasattr(target, "send_request") else getattr(target, "session", None)
    try:
        return session.__dict__.setdefault("_marft_session", uuid.uuid4().hex[:16]) if session is not None else None
    except Exception:  # noqa: BLE001 - a session that is not connected (2.x Client raises)
        return None


async def _captured(call: Any, target: Any, agent: str | None, name: str, arguments: Any, args: tuple,
                    kw: dict) -> Any:
    """One ``tools/call`` through ``call`` (the original), recorded when an episode is open."""
    if _CALL.get() is not None:
        return await call(name, arguments, *args, **kw)
    rec = current_episode()
    if rec is None:
        return await call(name, arguments, *args, **kw)
    tc = None
    with guarded("mcp.call_tool", rec):
        tc = _ToolCall(prop.begin_call(rec, agent, name, arguments))
        meta = dict(kw.get("meta") or {})
        prop.inject(meta, tc.step.ref)
        meta[prop.HALF_KEY] = "reply"  # a captured server sends its half back: no merge in the store
        kw = {**kw, "meta": meta}
    token = _CALL.set(tc)
    started, t0 = utcnow(), time.perf_counter()
    try:
        result = await call(name, arguments, *args, **kw)
    except BaseException as e:
        if tc is not None:
            _record_tool_step(tc, target, name, arguments, started, t0, None, error_text(e))
        raise
    finally:
        _CALL.reset(token)
    if tc is not None:
        if input_required(result):  # a 2.x round the caller retries: the last round is the step
            with guarded("mcp.round", rec):
                tc.step.settle(False)
            return result
        with guarded("mcp.reply_half", tc.step.recorder):
            _take_reply_half(tc.step, result)
        _record_tool_step(tc, target, name, arguments, started, t0, result, None)
    return result


def _record_tool_step(tc: _ToolCall, target: Any, name: str, arguments: Any, started: Any, t0: float,
                      result: Any, error: str | None) -> None:
    with guarded("mcp.tool_step", tc.step.recorder):
        fields = tool_fields(name, arguments)
        text, is_error = result_text(result) if result is not None else ("", False)
        meta = fields["metadata"]
        meta["latency_s"] = time.perf_counter() - t0
        meta["mcp.server"] = _server_name(target) or _half_server(tc.step)
        meta["mcp.session"] = _session_id(target)
        if is_error and error is None:
            error = text or "tool returned isError"
        who = tc.step.agent or "mcp_client"
        if tc.step.call_id is not None:  # the tool call a recorded model call asked for
            meta["tool_call_id"] = tc.step.call_id
            fields["observation"]["messages"][0]["tool_calls"][0]["id"] = tc.step.call_id
        tc.step.record(who, "tool", extra_deps=tc.sampled, started_at=started, output={"text": text},
                       error=error, validate=prop.needs_validation(who, text, error), **fields)


def _take_reply_half(step: prop.CallStep, result: Any) -> None:
    """Take the server's half out of the result's ``_meta`` (the app gets the result a server
    without capture would send) and record it after the tool step."""
    meta = getattr(result, "meta", None)
    if not isinstance(meta, dict) or prop.HALF_KEY not in meta:
        return
    half = meta.pop(prop.HALF_KEY)
    if not meta:
        result.meta = None
    if not prop.accept_reply_half(step, half):
        capture_error("mcp.reply_half", ValueError("the server's half in the reply does not start from this call"))


# -- sampling --------------------------------------------------------------------------------------


def _sampling_wrapper(orig: Any, agent: str | None) -> Any:
    async def sampling_callback(context: Any, params: Any) -> Any:
        call = _CALL.get()
        rec = call.step.recorder if call is not None else current_episode()
        started = utcnow()
        # The callback's own model call through the openai client is this sampling action (its
        # exact output, token data and adapter), not an action of its own.
        sink = oa.RawCall()
        token = oa.RAW_SINK.set(sink)
        try:
            result = await orig(context, params)
        finally:
            sink.done = True
            oa.RAW_SINK.reset(token)
        if rec is not None:
            with guarded("mcp.sampling", rec):
                aid = _record_sampling(rec, call, agent, params, result, started,
                                       sink if sink.response is not None else None)
                if call is not None:
                    call.sampled.append(aid)
        return result

    sampling_callback.marft_original = orig  # type: ignore[attr-defined]
    return sampling_callback


def _record_sampling(rec: Any, call: _ToolCall | None, agent: str | None, params: Any, result: Any,
                     started: Any, raw: Any = None) -> str:
    p = jsonable(params)
    msgs = [{"role": "system", "content": p["systemPrompt"]}] if p.get("systemPrompt") else []
    for m in p.get("messages") or []:
        msgs.append({"role": m.get("role", "user"), "content": block_text(m.get("content"))})
    fields: dict[str, Any] = {
        "observation": {"messages": msgs},
        "sampling": {"temperature": p.get("temperature"), "max_tokens": p.get("maxTokens"),
                     "stop": p.get("stopSequences")},
        "started_at": started,
        "metadata": {"mcp.sampling": True},
    }
    r = jsonable(result)
    if isinstance(r, dict) and "content" in r:
        fields["output"] = {"text": block_text(r["content"]), "finish_reason": r.get("stopReason")}
        if r.get("model"):
            fields["policy"] = {"name": str(r["model"])}
    else:
        fields["error"] = str(r.get("message") if isinstance(r, dict) else r)
    if raw is not None and "error" not in fields:  # what the model call itself returned and ran with
        exact = oa.call_fields(raw.path, raw.request or {}, raw.response)
        for k in ("output", "policy", "sampling", "token_source"):
            if exact.get(k) is not None:
                fields[k] = exact[k]
        fields["metadata"] = {**exact.get("metadata", {}), "mcp.sampling": True}
    if call is not None:
        who = call.step.agent or agent or "mcp_client"
        return rec.record_action(who, kind="llm", step=call.step.step, depends_on=call.step.depends_on, **fields)
    return rec.record_action(agent or "mcp_client", kind="llm", **fields)


# -- one client or session -------------------------------------------------------------------------


def _is_session(obj: Any) -> bool:
    return hasattr(obj, "send_request") and hasattr(obj, "call_tool")


def instrument_client(client: Any, agent: str | None = None, store: EpisodeSink | None = None) -> Any:
    """Capture ``call_tool`` (and the sampling callback) of one 2.x ``mcp.Client`` or one
    ``ClientSession``; returns it (see the module docstring). ``agent``: the agent using it, where
    no framework says whose the call is. ``store``: kept for symmetry with the server (tool calls
    join the current episode)."""
    if client.__dict__.get("_marft_mcp") is not None:
        return client
    if not supported():
        _unsupported()
        return client
    orig_call = client.call_tool

    async def call_tool(name: str, arguments: dict[str, Any] | None = None, *args: Any, **kw: Any) -> Any:
        return await _captured(orig_call, client, agent, name, arguments, args, kw)

    saved: dict[str, Any] = {"call_tool": orig_call}
    client.call_tool = call_tool
    if _is_session(client):  # its sampling callback is the session's own attribute in 1.x and 2.x
        orig = getattr(client, "_sampling_callback", None)
        if orig is not None and not orig.__name__.startswith("_default"):
            saved["_sampling_callback"] = orig
            client._sampling_callback = _sampling_wrapper(orig, agent)
    elif getattr(client, "sampling_callback", None) is not None:  # a 2.x Client (and its session, once open)
        orig = client.sampling_callback
        saved["sampling_callback"] = orig
        client.sampling_callback = _sampling_wrapper(orig, agent)
        session = getattr(client, "_session", None)
        if session is not None and getattr(session, "_sampling_callback", None) is orig:
            session._sampling_callback = client.sampling_callback
    client._marft_mcp = saved
    prop.CALLS.instrument(client)
    return client


def uninstrument_client(client: Any) -> Any:
    saved = client.__dict__.get("_marft_mcp")
    if saved is None:
        return client
    client.__dict__.pop("call_tool", None)
    if "_sampling_callback" in saved:
        client._sampling_callback = saved["_sampling_callback"]
    if "sampling_callback" in saved:
        session = getattr(client, "_session", None)
        if session is not None and getattr(session, "_sampling_callback", None) is client.sampling_callback:
            session._sampling_callback = saved["sampling_callback"]
        client.sampling_callback = saved["sampling_callback"]
    client._marft_mcp = None
    prop.CALLS.uninstrument(client)
    return client


# -- every session (process-wide) ------------------------------------------------------------------


def _unsupported() -> None:
    v = installed_version("mcp")
    capture_error("mcp.unsupported", RuntimeError(
        f"mcp {'.'.join(map(str, v)) if v else '(not installed)'} is outside the supported range "
        f"{'.'.join(map(str, SUPPORTED[0]))} <= v < {'.'.join(map(str, SUPPORTED[1]))}: not captured"))


def supported(v: tuple[int, ...] | None = None) -> bool:
    v = installed_version("mcp") if v is None else v
    return v is not None and SUPPORTED[0] <= v < SUPPORTED[1]



async def _session_call_tool(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    name, arguments = arg(args, kwargs, 0, "name"), arg(args, kwargs, 1, "arguments")
    rest = {k: v for k, v in kwargs.items() if k not in ("name", "arguments")}

    async def call(n: str, a: Any, *more: Any, **kw: Any) -> Any:
        return await wrapped(n, a, *more, **kw)

    return await _captured(call, instance, None, name, arguments, tuple(args[2:]), rest)


async def _session_initialize(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = await wrapped(*args, **kwargs)
    with guarded("mcp.initialize"):
        info = getattr(result, "serverInfo", None) or getattr(result, "server_info", None)
        if info is not None:
            instance.__dict__["_marft_server"] = info.name
    return result


def _targets() -> list:
    from mcp.client.session import ClientSession

    return [(ClientSession, "call_tool", _session_call_tool), (ClientSession, "initialize", _session_initialize)]


class McpState(CaptureState):
    """What ``instrument()`` keeps: the hooks on ``ClientSession``."""

    def __init__(self) -> None:
        self.hooks = Hooks("mcp", SUPPORTED, _targets, "MCP ClientSession capture is off; instrument_client() "
                                                         "still works per client")

    def start(self) -> None:
        self.hooks.install()
        prop.CALLS.instrument(self)

    def stop(self) -> None:
        self.hooks.uninstall()
        prop.CALLS.uninstrument(self)


MCP = Instrumentor(McpState)


def instrument() -> bool:
    """Capture every ``ClientSession.call_tool`` in the process (idempotent); False outside ``SUPPORTED``."""
    return MCP.instrument().hooks.installed


def uninstrument() -> None:
    """Restore ``ClientSession`` (idempotent)."""
    MCP.uninstrument()


__all__ = ["SUPPORTED", "CaptureMiddleware", "instrument", "instrument_client", "instrument_server", "result_text",
           "supported", "uninstrument", "uninstrument_client", "uninstrument_server"]
