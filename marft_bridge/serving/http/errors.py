"""OpenAI-shaped error bodies of the embedded server, and which status each failure answers.

Every refusal is ``{"error": {"message", "type", "param", "code"}}``; a validation failure names the
field by its path (``messages.0.content.0.text``); an unexpected fault is a 500 that names only the
request id (its details go to the log under that id).
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from ..engine.types import QueueFull, RequestError, UnknownAdapter

log = logging.getLogger(__name__)


class APIError(Exception):
    """A refusal (or a failure) to answer with ``status`` and an OpenAI error body; ``headers`` are
    added to the response (``Retry-After`` on a 429, ``Connection: close`` when the body is left unread)."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_body(e: APIError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def internal_error(rid: str) -> APIError:
    """The answer to an unexpected fault: its details stay in the log, under the request id."""
    return APIError(500, f"internal server error (request id {rid})", "server_error", code="internal_error")


def log_server_error(rid: str, e: APIError) -> None:
    if e.status >= 500:
        log.error("request %s: %s", rid, e.message)


def client_gone() -> APIError:
    """The client hung up before its answer: nobody reads this one (nginx's 499), nothing is logged."""
    return APIError(499, "the client closed the request", "client_closed_request")


def engine_error(e: Exception) -> APIError:
    """The answer to an error the engine raised for (or sent to) one request."""
    if isinstance(e, UnknownAdapter):
        return APIError(404, str(e), "NotFoundError", "model", "model_not_found")
    if isinstance(e, QueueFull):
        # A decode step takes milliseconds: within a second finished requests have made room.
        return APIError(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, RequestError):
        return APIError(400, str(e), "invalid_request_error", e.param, e.code)
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error")


def validation_error(e: ValidationError) -> APIError:
    """The most specific failure (the deepest location), named by its field path, e.g.
    ``messages.0.content.0.text``; union branch and discriminator tags are left out of the path."""
    err = max(e.errors(), key=lambda x: len(x["loc"]))
    parts: list[str] = []
    loc = err["loc"]
    for i, item in enumerate(loc):
        after_index = bool(parts) and parts[-1].isdigit()
        if isinstance(item, str) and ("[" in item or item in _UNION_TAGS
                                      or (after_index and item in _ROLES)
                                      or (after_index and item in _PART_TYPES and i < len(loc) - 1)):
            continue
        parts.append(str(item))
    param = ".".join(parts) or None
    return APIError(400, f"{param}: {err['msg']}" if param else err["msg"], "invalid_request_error", param)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}
_PART_TYPES = {"text", "refusal"}
