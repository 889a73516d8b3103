"""MCP: client sessions and served tools, captured across processes."""

from __future__ import annotations

from .client import (SUPPORTED, instrument_client, uninstrument_client, supported, McpState, MCP, instrument,
                     uninstrument)
from .server import (CaptureMiddleware, instrument_server, uninstrument_server)
from .records import (jsonable, result_text, tool_fields, block_text, error_text, input_required)

__all__ = ['CaptureMiddleware', 'MCP', 'McpState', 'SUPPORTED', 'block_text', 'error_text', 'input_required',
           'instrument', 'instrument_client', 'instrument_server', 'jsonable', 'result_text', 'supported',
           'tool_fields', 'uninstrument', 'uninstrument_client', 'uninstrument_server']
