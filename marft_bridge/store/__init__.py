"""Trace storage: ``TraceStore`` (SQLite by default, PostgreSQL by URL), JSONL/Parquet export and import.

Names resolve lazily so that ``marft --help`` (which imports ``store.cli``) does not pull in
SQLAlchemy and pydantic.
"""

from __future__ import annotations

from .._lazy import lazy_getattr


_EXPORTS = {
    "TraceStore": ".tracestore",
    "EpisodeFilter": ".filters",
    "AmbiguousEpisodeId": ".records",
    "DeadLetter": ".records",
    "DoctorReport": ".records",
    "EpisodeNotFound": ".records",
    "EpisodeUnreadable": ".records",
    "Refusal": ".records",
    "WriteReport": ".records",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
