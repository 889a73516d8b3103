"""OpenTelemetry GenAI spans in (intake: spans to episodes) and out (emit: episodes as spans)."""

from __future__ import annotations

from .episode import spans_to_episode
from .spans import DETAILS_EVENT, LLM_OPS
from .emit import (SAMPLING_ATTRS, SpanEmitter)
from .messages import (loads, genai_messages, oi_messages, tool_fields, offered_tools)

__all__ = ['DETAILS_EVENT', 'LLM_OPS', 'SAMPLING_ATTRS', 'SpanEmitter', 'genai_messages', 'loads',
           'offered_tools', 'oi_messages', 'spans_to_episode', 'tool_fields']


def __getattr__(name: str) -> object:
    # EpisodeSpanProcessor / EpisodeSpanExporter subclass the SDK's classes: built on first use, so
    # importing the package does not import opentelemetry-sdk.
    if name not in ("EpisodeSpanProcessor", "EpisodeSpanExporter"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(".intake", __name__), name)
