"""What the recorder shares with the rest of the capture: episode listeners, the process's default
store, JSON-safe copies of an app's values, and the time-ordered ids actions get."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from ..capture_errors import guarded
from ..schema import Episode
from .episode_context import CaptureState, Instrumentor
from ..seams import EpisodeSink


# -- listeners -----------------------------------------------------------------------------------


class Listeners(CaptureState):
    """The episode listeners as an active capture state: it exists while one is added."""

    def episode_finished(self, episode: Episode) -> None:
        for fn in LISTENERS.holders():
            with guarded(f"recording.listener {getattr(fn, '__name__', fn)}"):
                fn(episode)


LISTENERS = Instrumentor(Listeners)


def add_episode_listener(fn: Callable[[Episode], None]) -> None:
    LISTENERS.instrument(fn)


def remove_episode_listener(fn: Callable[[Episode], None]) -> None:
    LISTENERS.uninstrument(fn)


# -- default store -------------------------------------------------------------------------------
# One default database per process (``TraceStore.open()``, opened on first use), like logging's root
# logger: a resource every episode without a store shares, not a registry.

_default_store = None
_default_store_lock = threading.Lock()


def resolve_store(store: EpisodeSink) -> Any:
    global _default_store
    if store is not None:
        return store
    with _default_store_lock:
        if _default_store is None:
            from ..store import TraceStore

            _default_store = TraceStore.open()
        return _default_store


_SCALARS = (str, int, float, bool, type(None))


def jsonable(obj: Any) -> Any:
    """A JSON-safe copy of an app's input/output for ``Episode.task`` (messages become role/content)."""
    if isinstance(obj, _SCALARS):
        return obj
    if type(obj) is dict and all(type(k) is str and isinstance(v, _SCALARS) for k, v in obj.items()):
        return dict(obj)  # the common flat input, without a JSON round trip
    import json

    def default(o: Any) -> Any:
        if hasattr(o, "type") and hasattr(o, "content"):  # a LangChain message
            return {"role": o.type, "content": o.content}
        if hasattr(o, "model_dump"):
            return o.model_dump(mode="json")
        if isinstance(o, (set, frozenset, tuple)):
            return list(o)
        return repr(o)

    try:
        return json.loads(json.dumps(obj, default=default))
    except (TypeError, ValueError):
        return repr(obj)
    except RecursionError:  # too deep for JSON: kept as it is, for the store to refuse with a bounded preview
        return obj


def dumped(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value


def unicode_repaired(value: Any) -> Any:
    """``value`` with every string made valid Unicode (surrogate pairs joined, lone ones -> U+FFFD)."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, dict):
        return {unicode_repaired(k): unicode_repaired(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [unicode_repaired(v) for v in value]
    return value



def fast_id() -> str:
    # 32 hex digits laid out like a UUIDv7: 48 bits of Unix milliseconds, then 80 random bits.
    # Time-ordered keys land at the end of the store's b-trees, so a commit writes a few pages
    # instead of one random page per episode per index (README, "Trace store"; measured by
    # benchmarks/capture_overhead.py --stored N). ``random`` (no system call per id, hot path)
    # reseeds itself in forked children, so processes do not repeat ids. Span ids take the random
    # tail (propagation.span_id).
    return f"{(time.time_ns() // 1_000_000) << 80 | random.getrandbits(80):032x}"
