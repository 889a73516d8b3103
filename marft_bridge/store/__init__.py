"""Trace storage: ``TraceStore`` (SQLite by default, PostgreSQL by URL), JSONL/Parquet export and import."""

from .records import DeadLetter, EpisodeNotFound, Refusal, WriteReport
from .tracestore import TraceStore

__all__ = ["DeadLetter", "EpisodeNotFound", "Refusal", "TraceStore", "WriteReport"]
