"""Channel semantics by class: which LangGraph channels replace their value, which accumulate.

Replace-semantics channels are listed explicitly; **every other channel accumulates** (its value
keeps what earlier writes put there, so their writers stay in its provenance): an extra edge beats
a lost one. A channel class that is in neither list (a user's own, or one a LangGraph release
added) is treated as accumulating and counted in ``capture_stats()`` once per class.
Only ``langgraph.channels`` (public) is imported.
"""

from __future__ import annotations

import threading
from typing import Any

from ...capture_errors import capture_error

# Names in ``langgraph.channels``; a name a LangGraph version lacks is skipped.
REPLACE = ("LastValue", "LastValueAfterFinish", "AnyValue", "EphemeralValue", "UntrackedValue")
ACCUMULATE = ("BinaryOperatorAggregate", "DeltaChannel", "Topic", "NamedBarrierValue", "NamedBarrierValueAfterFinish")

_KINDS: dict[type, bool] = {}  # channel class -> accumulates
_LOCK = threading.Lock()
_classes: tuple[tuple[type, ...], tuple[type, ...]] | None = None


def _known() -> tuple[tuple[type, ...], tuple[type, ...]]:
    global _classes
    if _classes is None:
        import langgraph.channels as ch

        _classes = (tuple(c for n in REPLACE if (c := getattr(ch, n, None)) is not None),
                    tuple(c for n in ACCUMULATE if (c := getattr(ch, n, None)) is not None))
    return _classes


def classify(cls: type) -> str:
    """``"replace"``, ``"accumulate"`` or ``"unknown"`` (treated as accumulating)."""
    replace, accumulate = _known()
    # Most specific first: a subclass of an accumulating channel accumulates even if it also
    # derives from a replace one.
    if issubclass(cls, accumulate):
        return "accumulate"
    if issubclass(cls, replace):
        return "replace"
    return "unknown"


def accumulates(channel: Any) -> bool:
    """Whether a channel object keeps earlier writes (None, a missing channel: no)."""
    if channel is None:
        return False
    cls = type(channel)
    kind = _KINDS.get(cls)
    if kind is None:
        with _LOCK:
            c = classify(cls)
            kind = _KINDS[cls] = c != "replace"
        if c == "unknown":
            capture_error(f"langgraph.unknown_channel {cls.__module__}.{cls.__qualname__}",
                          TypeError(f"channel class {cls.__qualname__} is not classified; treated as accumulating"))
    return kind
