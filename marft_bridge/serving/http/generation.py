"""The bridge between the engine's worker thread and the server's event loop: one request's events
in an asyncio queue, its whole result or its server-sent-event stream, and its cancellation when
the client goes away (as vLLM's API server aborts a request on disconnect)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from ..engine.types import GenerationRequest, GenerationResult, QueueFull, RequestError, UnknownAdapter
from .errors import APIError, client_gone, engine_error, error_body, internal_error, log_server_error

log = logging.getLogger(__name__)


class Generation:
    """One request submitted to the engine: ``events()`` yields its ("start", (name, version)),
    ("token", TokenEvent) and ("done", GenerationResult) events on the event loop; an error the
    engine sends raises its ``APIError``. Submitting happens here, before any response starts, so a
    refused request (unknown model, bad settings, full queue) gets its status even when it asked
    for a stream."""

    def __init__(self, engine, req: GenerationRequest):
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        req.sink = lambda kind, payload: loop.call_soon_threadsafe(self._events.put_nowait, (kind, payload))
        try:
            engine.submit(req)
        except (UnknownAdapter, RequestError, QueueFull) as e:
            raise engine_error(e) from None
        self._engine, self.req = engine, req
        self._over = False  # its last event ("done" or "error") has been read
        self.adapter: dict | None = None  # {"name", "version"} once generation has started

    async def events(self) -> AsyncIterator[tuple[str, object]]:
        while True:
            kind, payload = await self._events.get()
            self._over = kind in ("done", "error")
            if kind == "error":
                raise engine_error(payload)
            if kind == "start":
                self.adapter = {"name": payload[0], "version": payload[1]}
            yield kind, payload
            if kind == "done":
                return

    def cancel(self) -> None:
        """Stop generating: the request leaves the engine's queue or batch before its next step."""
        if not self._over:
            self._engine.cancel(self.req)

    async def result(self, request: Request) -> GenerationResult:
        """The whole result. If the client disconnects first, generation stops and ``client_gone()``
        is raised (nobody reads that answer)."""
        work = asyncio.ensure_future(self._last())
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            done, _ = await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                task.cancel()  # nothing for a task that is done
            self.cancel()
        if work in done:
            return work.result()
        raise client_gone()

    async def _last(self) -> GenerationResult:
        async for kind, payload in self.events():
            if kind == "done":
                return payload

    def stream(self, chunks: AsyncIterator[dict], rid: str) -> StreamingResponse:
        """``chunks`` (made from ``events()``) as server-sent events; generation stops when the
        response ends however it ends: finished, failed, or the client gone."""
        return _EventStream(sse_stream(chunks, rid), self.cancel)


class _EventStream(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], on_close):
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        # Here rather than in the chunks' generator: a client gone before the first chunk is
        # noticed before the generator ever starts, and its ``finally`` would never run.
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is read by then: only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
