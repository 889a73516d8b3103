"""The OpenAI-compatible HTTP server: routes, request parsing, responses, errors, generation, tool calls, limits.
Names resolve lazily: FastAPI is imported only when an app is built."""

from __future__ import annotations

from ..._lazy import lazy_getattr

_EXPORTS = {
    "create_app": ".server",
    "HermesParser": ".tool_calls",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
