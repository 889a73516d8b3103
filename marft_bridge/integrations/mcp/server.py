"""Capture the tool calls an MCP server serves (mcp 2.x ``MCPServer``; mcp 1.x ``FastMCP`` or a
low-level ``Server``).

``instrument_server(server, store=None, agent=None)`` records each ``tools/call`` the server serves
(agent: the server's name) into the caller's episode, from the trace context the instrumented
client puts in ``params._meta`` (``traceparent`` + ``marft/caller``, see ``integrations.propagation``).
The server's action depends on the client's tool step. The instrumented client asks for the
server's half in the reply (``_meta["marft/half"]``, removed before the app sees the result) and
records it into its own episode, so the episode is written once; other halves (an in-process
server: straight into the client's recorder; a call that raised) are joined as
``integrations.propagation`` describes. Requests without trace context are served and not recorded.

The hook: on 2.x a middleware appended to ``server.middleware`` (the SDK's extension point); on
1.x, which has none, the low-level server's ``request_handlers[CallToolRequest]`` is wrapped (a
pass-through handler calling the original; ``uninstrument_server`` puts it back).
"""

from __future__ import annotations

import time
from typing import Any

from ...capture_errors import guarded
from ...schema import utcnow
from .. import openai as oa
from ..crossprocess import propagation as prop
from .records import error_text, input_required, result_text, tool_fields
from ...seams import EpisodeSink


class CaptureMiddleware:
    """MCP server middleware (``async (ctx, call_next)``) recording the ``tools/call`` requests it
    serves (see the module docstring); 1.x servers call it from the wrapped request handler."""

    def __init__(self, agent: str, store: EpisodeSink | None = None):
        self.agent = agent
        self.store = store
        prop.CALLS.instrument(self)

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
            rec = prop.callee_recorder(self.store, caller, source="mcp", metadata={"mcp.server": self.agent},
                                       nest_under=self.agent)
        if rec is None:
            return await call_next(ctx)
        params = ctx.params or {}
        if caller.action_id and (ctx.meta or {}).get(prop.HALF_KEY) == "reply":
            rec.store.reply = []  # the half goes back in the result (see ``_reply_with_half``)
        started, t0 = utcnow(), time.perf_counter()
        oa.OPENAI.instrument(rec)  # while it serves: the model calls a tool makes are the half's actions
        try:
            with rec.activate():
                result = await call_next(ctx)
        except BaseException as e:
            self._record(rec, params, started, t0, None, error_text(e))
            with guarded("mcp.server.reply_half", rec):
                prop.write_reply_half(rec, None)  # no reply to carry it
            raise
        finally:
            oa.OPENAI.uninstrument(rec)
        if input_required(result):
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
            if isinstance(result, dict):  # 2.x: the wire dict
                return {**result, "_meta": {**(result.get("_meta") or {}), prop.HALF_KEY: half}}
            model = getattr(result, "root", result)  # 1.x: ServerResult(CallToolResult)
            if hasattr(model, "meta"):
                model.meta = {**(model.meta or {}), prop.HALF_KEY: half}
                return result
            prop.write_reply_half(rec, half)
        return result

    def _record(self, rec: Any, params: Any, started: Any, t0: float, result: Any, error: str | None) -> None:
        with guarded("mcp.server.record", rec):
            name = str(params.get("name"))
            fields = tool_fields(name, params.get("arguments"))
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


class _Request:
    """A 1.x ``CallToolRequest`` as the middleware reads a 2.x context: method, params, meta."""

    method = "tools/call"

    def __init__(self, req: Any):
        p = req.params
        self.params = {"name": p.name, "arguments": p.arguments}
        meta = getattr(p, "meta", None)
        self.meta = meta.model_dump(by_alias=True, exclude_none=True) if meta is not None else None


def _low_level(server: Any) -> Any:
    """The 1.x low-level server that holds the request handlers (FastMCP's, or the server itself)."""
    low = getattr(server, "_mcp_server", server)
    return low if isinstance(getattr(low, "request_handlers", None), dict) else None


def instrument_server(server: Any, store: EpisodeSink | None = None, agent: str | None = None) -> Any:
    """Record the tool calls an MCP server serves; returns the server. ``agent`` defaults to its name."""
    name = agent or getattr(server, "name", None) or "mcp_server"
    if isinstance(getattr(server, "middleware", None), list):  # 2.x MCPServer
        if not any(isinstance(m, CaptureMiddleware) for m in server.middleware):
            server.middleware.append(CaptureMiddleware(name, store))
        return server
    low = _low_level(server)
    if low is None:
        raise TypeError(f"instrument_server() needs an MCP server (MCPServer, FastMCP or a low-level Server), "
                        f"got {type(server).__name__}")
    from mcp.types import CallToolRequest

    original = low.request_handlers.get(CallToolRequest)
    if original is None or hasattr(original, "marft_original"):
        return server  # no tools to call yet, or instrumented already
    middleware = CaptureMiddleware(name, store)

    async def handler(req: Any) -> Any:
        ctx = None
        with guarded("mcp.server.request"):
            ctx = _Request(req)
        if ctx is None:
            return await original(req)
        return await middleware(ctx, lambda _ctx: original(req))

    handler.marft_original = original  # type: ignore[attr-defined]
    handler.marft_middleware = middleware  # type: ignore[attr-defined]
    low.request_handlers[CallToolRequest] = handler
    return server


def uninstrument_server(server: Any) -> Any:
    if isinstance(getattr(server, "middleware", None), list):
        gone = [m for m in server.middleware if isinstance(m, CaptureMiddleware)]
        server.middleware[:] = [m for m in server.middleware if not isinstance(m, CaptureMiddleware)]
    else:
        low = _low_level(server)
        gone = []
        if low is not None:
            from mcp.types import CallToolRequest

            handler = low.request_handlers.get(CallToolRequest)
            if hasattr(handler, "marft_original"):
                low.request_handlers[CallToolRequest] = handler.marft_original
                gone = [handler.marft_middleware]
    for m in gone:
        prop.CALLS.uninstrument(m)
    return server


__all__ = ["CaptureMiddleware", "instrument_server", "uninstrument_server"]
