"""The embedded OpenAI-compatible HTTP server (FastAPI) in front of an ``AdapterEngine``.

Same surface as vLLM's multi-LoRA server: ``model`` = adapter name, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` for hot-swap, ``return_token_ids``. On top of it every response carries
``"adapter": {"name", "version"}`` (the registry version that produced it) and
``"logprobs_mode": "processed"`` (log-probs after temperature/top-k/top-p).

Laid out as vLLM's API server is: ``errors`` (error bodies) and ``request_parsing`` (key, body,
prompt), ``generation`` (the engine-to-event-loop bridge and SSE streaming), ``responses`` (pure
OpenAI shapes), ``routes`` (thin handlers); ``create_app`` only wires them. Bodies are validated
completely at the boundary (``requests.py``); every refusal, and any unexpected exception, answers
an OpenAI-shaped JSON error. Chat requests with ``tools`` render them through the base model's chat
template and parse Hermes ``<tool_call>`` output into ``tool_calls`` (``tool_calls.py``), as vLLM
with ``--tool-call-parser hermes`` does.
"""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import AdapterEngine
from .errors import APIError, error_body, internal_error, log_server_error
from .routes import ServerContext, router

log = logging.getLogger(__name__)


def create_app(engine: AdapterEngine, *, api_key: str | None = None, max_request_bytes: int = 1 << 20):
    """The FastAPI application. With ``api_key`` every ``/v1`` endpoint needs ``Authorization: Bearer
    <key>``; without one the admin endpoints are disabled altogether. Every refusal is an
    OpenAI-shaped error body; an unexpected exception is a 500 with the same shape, logged with the
    request id that the response's ``x-request-id`` header carries."""
    app = FastAPI(title="marft serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.marft = ServerContext(engine, api_key, max_request_bytes)
    app.include_router(router)
    app.add_middleware(_RequestIds)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        log_server_error(getattr(request.state, "request_id", "?"), e)
        return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        type_ = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(APIError(e.status_code, str(e.detail), type_)), status_code=e.status_code)

    return app


class _RequestIds:
    """Gives every request an id (``request.state.request_id`` and the ``x-request-id`` header) and
    answers an exception no handler caught with a JSON 500 naming it. Plain ASGI rather than
    ``@app.middleware``: that one hands the endpoints a copy of the body stream, and they must read
    the body as it arrives and see the client's disconnect themselves."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = f"req-{uuid.uuid4().hex[:16]}"
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - any fault in a request answers JSON, never a bare 500
            log.exception("request %s (%s %s) failed", rid, scope.get("method"), scope.get("path"))
            if not started:  # else the answer is half sent: the server closes the connection
                await JSONResponse(error_body(internal_error(rid)), status_code=500)(scope, receive, send_with_id)
