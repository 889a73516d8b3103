"""A2A: clients and served agents captured across processes."""

from __future__ import annotations

from .capture import (CaptureInterceptor, instrument_client, uninstrument_client, connect, CaptureExecutor)

__all__ = ['CaptureExecutor', 'CaptureInterceptor', 'connect', 'instrument_client', 'uninstrument_client']
