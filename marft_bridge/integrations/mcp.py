"""Capture MCP tool use (python SDK ``mcp`` 2.x) on the client and on the server.

Client: ``instrument_client(client, agent=None, store=None)`` wraps one ``mcp.Client``. Inside an
episode (``marft_bridge.episode(...)`` or a captured LangGraph run) every ``call_tool`` becomes a
``kind="tool"`` action (an environment step, not trained): the tool name and arguments (in
``observation`` and ``metadata``), the result text or the error, ``metadata["latency_s"]``. It
depends on the model call that asked for it (inside a LangGraph node: the node's inputs; else the
latest ``llm`` action of ``agent``, or of anyone), and the agent's next model call depends on it
(LangGraph data flow, or the tool result appearing in the next prompt). The client's
``sampling_callback`` (the server asking the client's model) is recorded as an ``llm`` action of
``agent``; the tool step then depends on it. Outside an episode nothing is recorded.

Server: ``instrument_server(server, store=None, agent=None)`` appends a middleware to an
``MCPServer`` that records each ``tools/call`` it serves (agent: the server's name) into the
caller's episode, from the trace context the instrumented client puts in ``params._meta``
(``traceparent`` + ``marft/caller``, see ``integrations.propagation``). The server's action depends on
the client's tool step. The instrumented client asks for the server's half in the reply
(``_meta["marft/half"]``, removed before the app sees the result) and records it into its own
episode, so the episode is written once; other halves (an in-process server: straight into the
client's recorder; a call that raised) are joined as ``integrations.propagation`` describes.
Requests without trace context are served and not recorded.

Capture never changes what a call returns or raises: an MCP error result, an exception or a
server that dies mid-call is recorded as a failed step (``error``) and then returned / raised as
it would have been.
"""

from __future__ import annotations

import contextvars
import json
import time
from dataclasses import dataclass, field
from typing import Any

from .. import recording
from ..capture_errors import capture_error, guarded
from ..episode_context import current_episode
from ..schema import utcnow
from . import propagation as prop

_CALL: contextvars.ContextVar[_ToolCall | None] = contextvars.ContextVar("marft_mcp_call", default=None)


@dataclass
class _ToolCall:
    step: prop.CallStep
    sampled: list[str] = field(default_factory=list)


def _jsonable(v: Any) -> Any:
    if hasattr(v, "model_dump"):
        return v.model_dump(mode="json", by_alias=True, exclude_none=True)
    return recording.jsonable(v)


def result_text(result: Any) -> tuple[str, bool]:
    """The text of a tool result (model or wire dict) and whether it is an error result."""
    if type(result).__name__ == "CallToolResult" and isinstance(getattr(result, "content", None), list):
        # The SDK's result model, read as it is (a model dump per call costs more than the rest).
        text = "\n".join(c.text for c in result.content if getattr(c, "type", None) == "text")
        if not text and result.structured_content is not None:
            text = json.dumps(_jsonable(result.structured_content), sort_keys=True)
        return text, bool(result.is_error)
    # A wire dict (what a server middleware sees) is read as it is; anything else is dumped first.
    data = result if isinstance(result, dict) else _jsonable(result)
    if not isinstance(data, dict):
        return str(data), False
    texts = [c.get("text", "") for c in data.get("content") or [] if isinstance(c, dict) and c.get("type") == "text"]
    text = "\n".join(texts)
    if not text and data.get("structuredContent") is not None:
        text = json.dumps(_jsonable(data["structuredContent"]), sort_keys=True)
    return text, bool(data.get("isError"))


def _tool_fields(name: str, arguments: Any) -> dict[str, Any]:
    args = _jsonable(arguments or {})
    call = {"type": "function", "function": {"name": name, "arguments": json.dumps(args, sort_keys=True)}}
    return {
        "observation": {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]},
        "metadata": {"mcp.tool": name, "mcp.arguments": args},
    }


def _block_text(content: Any) -> str:
    """The text of a sampling message's content: one block or a list of them (dumped)."""
    blocks = content if isinstance(content, list) else [content]
    return "\n".join(b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# -- client ----------------------------------------------------------------------------------------


def instrument_client(client: Any, agent: str | None = None, store: Any = None) -> Any:
    """Capture ``client.call_tool`` and its sampling callback; returns the client (see module doc).

    ``agent``: the agent using this client (tool steps and sampling calls are its actions);
    default: the agent whose model call asked for the tool. ``store``: for episodes the capture
    opens itself (none: tool calls join the current episode).
    """
    if getattr(client, "_marft_mcp", None) is not None:
        return client
    orig_call = client.call_tool
    orig_sampling = client.sampling_callback

    async def call_tool(name: str, arguments: dict[str, Any] | None = None, *args: Any, **kw: Any) -> Any:
        rec = current_episode()
        if rec is None:
            return await orig_call(name, arguments, *args, **kw)
        call = None
        with guarded("mcp.call_tool", rec):
            call = _ToolCall(prop.begin_call(rec, agent))
            meta = dict(kw.get("meta") or {})
            prop.inject(meta, call.step.ref)
            meta[prop.HALF_KEY] = "reply"  # a captured server sends its half back: no merge in the store
            kw["meta"] = meta
        token = _CALL.set(call)
        started, t0 = utcnow(), time.perf_counter()
        try:
            result = await orig_call(name, arguments, *args, **kw)
        except BaseException as e:
            if call is not None:
                _record_tool_step(call, name, arguments, started, t0, None, _error(e))
            raise
        finally:
            _CALL.reset(token)
        if call is not None:
            with guarded("mcp.reply_half", call.step.recorder):
                _take_reply_half(call.step, result)
            _record_tool_step(call, name, arguments, started, t0, result, None)
        return result

    def _record_tool_step(call: _ToolCall, name: str, arguments: Any, started: Any, t0: float, result: Any,
                          error: str | None) -> None:
        with guarded("mcp.tool_step", call.step.recorder):
            fields = _tool_fields(name, arguments)
            text, is_error = result_text(result) if result is not None else ("", False)
            fields["metadata"]["latency_s"] = time.perf_counter() - t0
            fields["metadata"]["mcp.server"] = _server_name(client)
            if is_error and error is None:
                error = text or "tool returned isError"
            who = agent or call.step.dep_agent() or "mcp_client"
            call.step.record(who, "tool", extra_deps=call.sampled, started_at=started, output={"text": text},
                             error=error, validate=prop.needs_validation(who, text, error), **fields)

    async def sampling_callback(context: Any, params: Any) -> Any:
        call = _CALL.get()
        rec = call.step.recorder if call is not None else current_episode()
        started = utcnow()
        result = await orig_sampling(context, params)
        if rec is not None:
            with guarded("mcp.sampling", rec):
                aid = _record_sampling(rec, call, params, result, started)
                if call is not None:
                    call.sampled.append(aid)
        return result

    def _record_sampling(rec: Any, call: _ToolCall | None, params: Any, result: Any, started: Any) -> str:
        p = _jsonable(params)
        msgs = [{"role": "system", "content": p["systemPrompt"]}] if p.get("systemPrompt") else []
        for m in p.get("messages") or []:
            msgs.append({"role": m.get("role", "user"), "content": _block_text(m.get("content"))})
        fields: dict[str, Any] = {
            "observation": {"messages": msgs},
            "sampling": {"temperature": p.get("temperature"), "max_tokens": p.get("maxTokens"),
                         "stop": p.get("stopSequences")},
            "started_at": started,
            "metadata": {"mcp.sampling": True},
        }
        r = _jsonable(result)
        if isinstance(r, dict) and "content" in r:
            fields["output"] = {"text": _block_text(r["content"]), "finish_reason": r.get("stopReason")}
            if r.get("model"):
                fields["policy"] = {"name": str(r["model"])}
        else:
            fields["error"] = str(r.get("message") if isinstance(r, dict) else r)
        who = agent or (call.step.dep_agent() if call is not None else None) or "mcp_client"
        if call is not None:
            return rec.record_action(who, kind="llm", step=call.step.step, depends_on=call.step.depends_on, **fields)
        return rec.record_action(who, kind="llm", **fields)

    client.call_tool = call_tool
    if orig_sampling is not None:
        client.sampling_callback = sampling_callback
        session = getattr(client, "_session", None)
        if session is not None and getattr(session, "_sampling_callback", None) is orig_sampling:
            session._sampling_callback = sampling_callback
    client._marft_mcp = {"call_tool": orig_call, "sampling_callback": orig_sampling}
    return client


def uninstrument_client(client: Any) -> Any:
    orig = getattr(client, "_marft_mcp", None)
    if orig is None:
        return client
    del client.call_tool
    if orig["sampling_callback"] is not None:
        session = getattr(client, "_session", None)
        if session is not None and getattr(session, "_sampling_callback", None) is client.sampling_callback:
            session._sampling_callback = orig["sampling_callback"]
        client.sampling_callback = orig["sampling_callback"]
    client._marft_mcp = None
    return client


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


def _server_name(client: Any) -> str | None:
    try:
        info = client.server_info
        return info.name if info is not None else None
    except Exception:  # noqa: BLE001 - not connected yet
        return None


# -- server ----------------------------------------------------------------------------------------


class CaptureMiddleware:
    """``MCPServer`` middleware recording the ``tools/call`` requests it serves (see module doc)."""

    def __init__(self, agent: str, store: Any = None):
        self.agent = agent
        self.store = store

    async def __call__(self, ctx: Any, call_next: Any) -> Any:
        if ctx.method != "tools/call":
            return await call_next(ctx)
        caller = None
        with guarded("mcp.server.extract"):
            caller = prop.extract(ctx.meta)
        if caller is None:
            return await call_next(ctx)
        rec = None
        with guarded("mcp.server.open"):
            rec = prop.callee_recorder(self.store, caller, source="mcp", metadata={"mcp.server": self.agent})
        if rec is None:
            return await call_next(ctx)
        params = ctx.params or {}
        if caller.action_id and (ctx.meta or {}).get(prop.HALF_KEY) == "reply":
            rec.store.reply = []  # the half goes back in the result (see ``_reply_with_half``)
        started, t0 = utcnow(), time.perf_counter()
        try:
            with rec.activate():
                result = await call_next(ctx)
        except BaseException as e:
            self._record(rec, params, started, t0, None, _error(e))
            with guarded("mcp.server.reply_half", rec):
                prop.write_reply_half(rec, None)  # no reply to carry it
            raise
        if _input_required(result):
            # An intermediate round (the server asks the client's model first): the retried
            # request records the call when it completes.
            with guarded("mcp.server.round", rec):
                if prop.recorded(rec):
                    rec.finish()
                prop.write_reply_half(rec, None)
            return result
        self._record(rec, params, started, t0, result, None)
        return self._reply_with_half(rec, result)

    def _reply_with_half(self, rec: Any, result: Any) -> Any:
        half = None
        with guarded("mcp.server.reply_half", rec):
            half = prop.reply_half(rec)
            if half is None:
                return result
            if isinstance(result, dict):
                return {**result, "_meta": {**(result.get("_meta") or {}), prop.HALF_KEY: half}}
            prop.write_reply_half(rec, half)
        return result

    def _record(self, rec: Any, params: Any, started: Any, t0: float, result: Any, error: str | None) -> None:
        with guarded("mcp.server.record", rec):
            name = str(params.get("name"))
            fields = _tool_fields(name, params.get("arguments"))
            fields["metadata"]["latency_s"] = time.perf_counter() - t0
            text, is_error = result_text(result) if result is not None else ("", False)
            if is_error and error is None:
                error = text or "tool returned isError"
            own = prop.recorded(rec)  # what it recorded while serving, not the halves of servers it called
            inner = [a[3] for a in own]
            step = max((a[2] for a in own), default=-1) + 1
            rec.record_action(self.agent, kind="tool", step=step, depends_on=inner, started_at=started,
                              output={"text": text},
                              error=error, validate=prop.needs_validation(self.agent, text, error), **fields)
            rec.finish("failed" if error else "completed")


def _input_required(result: Any) -> bool:
    if type(result).__name__ == "InputRequiredResult":
        return True
    return isinstance(result, dict) and ("inputRequests" in result or result.get("resultType") == "input_required")


def instrument_server(server: Any, store: Any = None, agent: str | None = None) -> Any:
    """Record the tool calls an ``MCPServer`` serves; returns the server. ``agent`` defaults to its name."""
    if any(isinstance(m, CaptureMiddleware) for m in server.middleware):
        return server
    server.middleware.append(CaptureMiddleware(agent or server.name, store))
    return server


def uninstrument_server(server: Any) -> Any:
    server.middleware[:] = [m for m in server.middleware if not isinstance(m, CaptureMiddleware)]
    return server


__all__ = ["CaptureMiddleware", "instrument_client", "instrument_server", "result_text",
           "uninstrument_client", "uninstrument_server"]
