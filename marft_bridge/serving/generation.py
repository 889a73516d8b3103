"""The bridge between the engine's worker thread and the server's event loop: one request's events
in an asyncio queue, and a response streamed as server-sent events."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from .api_errors import APIError, engine_error, error_body, internal_error, log_server_error
from .engine_types import GenerationRequest, GenerationResult, RequestError, UnknownAdapter

log = logging.getLogger(__name__)


class Generation:
    """One request submitted to the engine: ``events()`` yields its ("start", (name, version)),
    ("token", TokenEvent) and ("done", GenerationResult) events on the event loop; an error the
    engine sends raises its ``APIError``. Submitting happens here, before any response starts, so a
    refused request (unknown model, bad settings) gets its status even when it asked for a stream."""

    def __init__(self, engine, req: GenerationRequest):
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        req.sink = lambda kind, payload: loop.call_soon_threadsafe(self._events.put_nowait, (kind, payload))
        try:
            engine.submit(req)
        except (UnknownAdapter, RequestError) as e:
            raise engine_error(e) from None
        self.req = req
        self.adapter: dict | None = None  # {"name", "version"} once generation has started

    async def events(self) -> AsyncIterator[tuple[str, object]]:
        while True:
            kind, payload = await self._events.get()
            if kind == "error":
                raise engine_error(payload)
            if kind == "start":
                self.adapter = {"name": payload[0], "version": payload[1]}
            yield kind, payload
            if kind == "done":
                return

    async def result(self) -> GenerationResult:
        async for kind, payload in self.events():
            if kind == "done":
                return payload


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def sse_stream(chunks: AsyncIterator[dict], rid: str) -> AsyncIterator[str]:
    """A streamed response: each chunk as an event, then ``[DONE]``. A failure after the stream
    has started (its 200 is sent) goes in the stream as an OpenAI-shaped error event."""
    try:
        async for obj in chunks:
            yield sse(obj)
    except APIError as e:
        log_server_error(rid, e)
        yield sse(error_body(e))
    except Exception:  # noqa: BLE001 - the stream has started: the error goes in it, as JSON
        log.exception("request %s: stream failed", rid)
        yield sse(error_body(internal_error(rid)))
    yield "data: [DONE]\n\n"
