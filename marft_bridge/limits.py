"""Record limits: how deep and how big the free-form JSON of a record may be.

An app's user controls what lands in ``Episode.task``, metadata and tool arguments. Without a
bound, one request nested a few hundred levels deep is accepted and stored but can never be read
back (pydantic's JSON parser stops at 200 levels), and one huge line is read whole into memory by
``marft traces import``. So the record model refuses, at every entry to the store (capture,
``add_episode``, import, the OTel processor), what is past these limits:

- ``max_depth`` (64): nesting levels of containers (objects and arrays) in one free-form field.
  At most 128, so a stored record, with its own few levels around the field, always stays well
  below the parser's 200.
- ``max_field_bytes`` (2,000,000): the JSON text of one free-form field — ``Episode.task`` and
  ``metadata``, ``Action.metadata``, ``Reward.metadata``, the tool calls of a message or an
  output, ``Observation.tools`` and ``tool_choice`` — as the message text cap (2,000,000
  characters) bounds ``content``. Strings count by their UTF-8 length, escapes aside.
- ``max_record_bytes`` (64 MiB): one episode's JSON as a whole: a line of a JSONL import, the
  rows of a Parquet import's episode, an episode written to the store (merges included), so what
  the store holds always exports and imports again.

Defaults come from the environment when set (``MARFT_MAX_JSON_DEPTH``, ``MARFT_MAX_FIELD_BYTES``,
``MARFT_MAX_RECORD_BYTES``); ``TraceStore.open(url, limits=RecordLimits(...))`` overrides them for
one store. Validation with no store (``Episode(...)``, ``parse_episode``) uses the defaults.

The record model checks each field (``first_over_limits``); the store, which serializes every
record anyway, first judges the records from that JSON (``record_within``), the same limits at
less cost on the capture path.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import to_json

from .errors import MarftError

ENV = {"max_depth": "MARFT_MAX_JSON_DEPTH", "max_field_bytes": "MARFT_MAX_FIELD_BYTES",
       "max_record_bytes": "MARFT_MAX_RECORD_BYTES"}
_SCALAR_BYTES = 8  # a number, true/false/null or an object that is not JSON: about this much text
_ESCAPE = re.compile(rb"\\.", re.DOTALL)  # in JSON text only inside strings
_NOT_QUOTE_OR_BRACKET = bytes(sorted(set(range(256)) - set(b'"{}[]')))
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")  # depth does not depend on the kind of container


class RecordLimits(BaseModel):
    """Depth and size limits of records (see the module docstring); immutable, picklable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_depth: int = Field(64, ge=1, le=128)
    max_field_bytes: int = Field(2_000_000, ge=1024)
    max_record_bytes: int = Field(64 * 2**20, ge=4096)

    @classmethod
    def from_env(cls, **overrides: Any) -> RecordLimits:
        """The defaults, with ``$MARFT_MAX_*`` where set, then ``overrides``; MarftError names a bad value."""
        values: dict[str, Any] = {}
        for name, var in ENV.items():
            text = os.environ.get(var)
            if text:
                try:
                    values[name] = int(text.replace("_", ""))
                except ValueError:
                    raise MarftError(f"${var}={text!r}: not a whole number") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ValidationError as e:
            err = e.errors()[0]
            name = str(err["loc"][0]) if err["loc"] else "limits"
            raise MarftError(f"record limit {name} ({ENV.get(name, name)}): {err['msg']}") from None

    @classmethod
    def of(cls, limits: RecordLimits | dict | None) -> RecordLimits:
        """``limits`` as RecordLimits: None -> ``from_env()``; a dict -> those fields over ``from_env()``."""
        if limits is None:
            return cls.from_env()
        if isinstance(limits, dict):
            return cls.from_env(**limits)
        if isinstance(limits, cls):
            return limits
        raise MarftError(f"limits must be RecordLimits or a dict of its fields, not {type(limits).__name__}")


@functools.cache
def default_limits() -> RecordLimits:
    """The limits validation uses when no store gives its own: ``from_env()`` at first use (a store
    reads the environment when it is opened)."""
    return RecordLimits.from_env()


def over_limits(value: Any, limits: RecordLimits) -> str | None:
    """Why ``value`` (one free-form field) is past ``limits``, or None when it is within them.

    The walk is iterative (no recursion: a value nested 100,000 levels deep, or one that contains
    itself, is judged without a RecursionError) and stops at the first level or byte past a limit.
    It runs for every record written, so the common case is C and Rust: the value's JSON text
    (pydantic-core) gives its size and its depth (``_depth_within``). What has no JSON text
    (objects that are not JSON, a value containing itself, one too deep to serialize) is walked.
    """
    cap = limits.max_field_bytes
    t = type(value)
    if t is str:
        n = len(value) if value.isascii() else len(value.encode("utf-8", "replace"))
        return _too_big(n, limits) if n > cap else None
    if t is not dict and t is not list and not isinstance(value, (dict, list, tuple)):
        return None
    try:
        text = to_json(value)
    except Exception:  # noqa: BLE001 - no JSON text: judged by the walk below
        return _walk(value, limits)
    if len(text) > cap:
        return _too_big(len(text), limits)
    return None if _depth_within(text, limits.max_depth) else _deeper(limits)


def first_over_limits(fields: list[tuple[str, Any]], limits: RecordLimits) -> tuple[str, str] | None:
    """(field, reason) of the first of ``fields`` (name, value) past ``limits``, or None.

    The fields of one record are judged together first, from one JSON text of them all: within the
    byte limit as a whole is within it one by one, and the list around them adds one level. Only
    when that is not clear is each judged on its own (to name the one past a limit).
    """
    values = [v for _, v in fields if v]
    if not values:
        return None
    try:
        text = to_json(values)
    except Exception:  # noqa: BLE001 - no JSON text: each is judged on its own below
        text = None
    if text is not None and len(text) <= limits.max_field_bytes and _depth_within(text, limits.max_depth + 1):
        return None
    for name, value in fields:
        if value and (reason := over_limits(value, limits)):
            return name, reason
    return None


def record_within(record: Any, text: bytes, limits: RecordLimits) -> bool:
    """Whether the free-form fields of ``record`` (its ``limited_fields()``) are within ``limits``,
    judged first from ``text``, the record's JSON as pydantic-core writes it: each field is written
    there as ``to_json`` writes it, one level inside at least, so a text within ``max_field_bytes``
    with no more than ``max_depth + 1`` brackets in all clears them without a look at them. Else
    they are judged as the record model judges them (``first_over_limits``)."""
    if len(text) <= limits.max_field_bytes and text.count(b"{") + text.count(b"[") <= limits.max_depth + 1:
        return True
    return first_over_limits(record.limited_fields(), limits) is None


def _depth_within(text: bytes, max_depth: int) -> bool:
    """Whether JSON ``text`` (as ``to_json`` writes it) nests containers at most ``max_depth`` deep.

    Few brackets in all decide it at once. Else the brackets outside strings are peeled, innermost
    pairs first, one level a pass; every step is one scan of bytes in C. To find them: every escape
    (a backslash and the character after it) is dropped, so each quote left opens or closes a
    string; then all but quotes and brackets; then two quotes side by side (an empty string, or
    the end of one and the start of the next: no bracket between them is structure); then what
    lies between the quotes that are left.
    """
    if text.count(b"{") + text.count(b"[") <= max_depth:
        return True
    if b"\\" in text:
        text = _ESCAPE.sub(b"", text)
    marks = text.translate(None, _NOT_QUOTE_OR_BRACKET).replace(b'""', b"")
    if b'"' in marks:
        marks = b"".join(marks.split(b'"')[::2])
    brackets = marks.translate(_AS_SQUARE)
    for _ in range(max_depth):
        if not brackets:
            return True
        brackets = brackets.replace(b"[]", b"")  # the pairs that hold nothing now: one level
    return not brackets


def _deeper(limits: RecordLimits) -> str:
    return f"JSON nested more than {limits.max_depth} levels deep, over the limit (max_depth)"


def _walk(value: Any, limits: RecordLimits) -> str | None:
    """``over_limits`` by walking the containers, with a stack instead of recursion."""
    cap, max_depth = limits.max_field_bytes, limits.max_depth
    size = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        v, depth = pop()
        if depth > max_depth:
            return _deeper(limits)
        if type(v) is dict or isinstance(v, dict):
            # braces; per key its text, quotes, colon and comma
            size += 2 + sum((len(k) if type(k) is str else _SCALAR_BYTES) + 4 for k in v)
            items = v.values()
        else:
            size += 2 + len(v)  # brackets and commas
            items = v
        for x in items:
            tx = type(x)
            if tx is str:
                size += len(x) + 2 if x.isascii() else len(x.encode("utf-8", "replace")) + 2
            elif tx is dict or tx is list or isinstance(x, (dict, list, tuple)):
                push((x, depth + 1))
            else:
                size += _SCALAR_BYTES
        if size > cap:
            return _too_big(size, limits)
    return None


def _too_big(size: int, limits: RecordLimits) -> str:
    return f"{size:,}+ bytes of JSON, over the {limits.max_field_bytes:,}-byte limit (max_field_bytes)"
