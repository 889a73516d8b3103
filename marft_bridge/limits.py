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
"""

from __future__ import annotations

import functools
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import MarftError

ENV = {"max_depth": "MARFT_MAX_JSON_DEPTH", "max_field_bytes": "MARFT_MAX_FIELD_BYTES",
       "max_record_bytes": "MARFT_MAX_RECORD_BYTES"}
_SCALAR_BYTES = 8  # a number, true/false/null or an object that is not JSON: about this much text


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


def default_limits() -> RecordLimits:
    """The limits validation uses when no store gives its own: ``from_env()`` for the environment now."""
    return _limits_for(tuple(os.environ.get(var) for var in ENV.values()))


@functools.lru_cache(maxsize=8)
def _limits_for(_env: tuple) -> RecordLimits:
    return RecordLimits.from_env()


def over_limits(value: Any, limits: RecordLimits) -> str | None:
    """Why ``value`` (one free-form field) is past ``limits``, or None when it is within them.

    The walk is iterative (no recursion: a value nested 100,000 levels deep, or one that contains
    itself, is judged without a RecursionError) and stops at the first level or byte past a limit.
    """
    if value is None or type(value) in (str, int, float, bool):
        n = len(value) if type(value) is str else 0
        return _too_big(n, limits) if n > limits.max_field_bytes else None
    max_depth, cap = limits.max_depth, limits.max_field_bytes
    size = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if type(v) is dict or isinstance(v, dict):
            items = v.values()
            for k in v:
                size += (len(k) if type(k) is str else _SCALAR_BYTES) + 4  # "key": and the comma
        elif type(v) in (list, tuple) or isinstance(v, (list, tuple)):
            items = v
        else:
            continue
        if depth > max_depth:
            return f"JSON nested more than {max_depth} levels deep, over the limit (max_depth)"
        size += 2
        for x in items:
            t = type(x)
            if t is str:
                size += (len(x) if x.isascii() else len(x.encode("utf-8", "replace"))) + 3
            elif t is dict or t is list or t is tuple or isinstance(x, (dict, list, tuple)):
                stack.append((x, depth + 1))
            else:
                size += _SCALAR_BYTES
        if size > cap:
            return _too_big(size, limits)
    return None


def _too_big(size: int, limits: RecordLimits) -> str:
    return f"{size:,}+ bytes of JSON, over the {limits.max_field_bytes:,}-byte limit (max_field_bytes)"
