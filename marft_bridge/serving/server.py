"""The embedded OpenAI-compatible HTTP server (FastAPI) in front of an ``AdapterEngine``.

Same surface as vLLM's multi-LoRA server: ``model`` = adapter name, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` for hot-swap, ``return_token_ids``. On top of it every response carries
``"adapter": {"name", "version"}`` (the registry version that produced it) and
``"logprobs_mode": "processed"`` (log-probs after temperature/top-k/top-p).

Laid out as vLLM's API server is: ``api_errors`` (error bodies) and ``request_parsing`` (key, body,
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

from .api_errors import APIError, error_body, internal_error, log_server_error
from .engine import AdapterEngine
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

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        rid = f"req-{uuid.uuid4().hex[:16]}"
        request.state.request_id = rid
        try:
            response = await call_next(request)
        except Exception:  # noqa: BLE001 - any fault in a request answers JSON, never a bare 500
            log.exception("request %s (%s %s) failed", rid, request.method, request.url.path)
            response = JSONResponse(error_body(internal_error(rid)), status_code=500)
        response.headers["x-request-id"] = rid
        return response

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        log_server_error(getattr(request.state, "request_id", "?"), e)
        return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        type_ = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(APIError(e.status_code, str(e.detail), type_)), status_code=e.status_code)

    return app
