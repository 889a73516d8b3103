"""Capture from OpenAI-compatible clients (the ``openai`` package, and ``langchain_openai`` on top of
it): the client hook (``client``), one request/response pair as record fields (``fields``), tool-call
dependencies (``calls``) and tapped streams (``streams``). See ``client`` for where a call lands."""

from __future__ import annotations

from ...registry_state import RegistryStateReader as LiveVersions  # the reader; the protocol is seams.LiveVersions
from .calls import call_dependencies, call_inputs, emitter_of, message_dependencies, note_response, note_tool_calls
from .client import OPENAI, SUPPORTED, instrument, instrumented, uninstrument, use_registry
from .fields import (CHAT_PATH, RAW_SINK, REGISTRY_KEY, RESPONSES_PATH, RawCall, call_fields, completion_fields,
                     responses_fields, token_data)
from .streams import STREAM_KEY, ResponsesStreamAccumulator, StreamAccumulator

DISTRIBUTION = "openai"

__all__ = ["CHAT_PATH", "DISTRIBUTION", "OPENAI", "RAW_SINK", "REGISTRY_KEY", "RESPONSES_PATH", "STREAM_KEY",
           "SUPPORTED", "LiveVersions", "RawCall", "ResponsesStreamAccumulator", "StreamAccumulator",
           "call_dependencies", "call_fields", "call_inputs", "completion_fields", "emitter_of", "instrument",
           "instrumented", "message_dependencies", "note_response", "note_tool_calls", "responses_fields",
           "token_data", "uninstrument", "use_registry"]
