"""Trace storage: ``TraceStore`` (SQLite by default, PostgreSQL by URL), JSONL/Parquet export and import.

Names resolve lazily so that ``marft --help`` (which imports ``store.cli``) does not pull in
SQLAlchemy and pydantic.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TraceStore": ".tracestore",
    "DeadLetter": ".records",
    "EpisodeNotFound": ".records",
    "Refusal": ".records",
    "WriteReport": ".records",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'marft_bridge.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
