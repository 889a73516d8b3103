"""Exceptions shared by every part of marft_bridge."""

from __future__ import annotations


class MarftError(Exception):
    """Base class: a failure the user can act on. The CLI prints it as one line."""


class RecordError(MarftError, ValueError):
    """A Flex-POMDP record that breaks the schema or an invariant.

    ``record`` names the record (an episode id, or ``line 12`` of a file), ``field`` the offending
    field as a dotted path (``actions.3.depends_on``), ``reason`` what is wrong with it.
    """

    def __init__(self, record: str | None, field: str | None, reason: str):
        self.record = record
        self.field = field
        self.reason = reason
        super().__init__(": ".join(p for p in (record, field, reason) if p))
