"""Capture-error accounting: capture must never break the application.

Adapters wrap their own work in ``guarded(...)``: an exception there is logged and counted, never
raised into the app. Only the standard library is imported here, so every capture module can use
it without pulling in the recorder.

API
---
``guarded(where, recorder=None)``: context manager that logs + counts any exception.
``capture_error(where, exc, recorder=None)`` counts one (and on ``recorder``, which carries its
count into the episode's metadata); ``capture_stats()`` returns
``{"errors": n, "by_where": {...}, "last": "...", "store": {...}}``; ``reset_capture_stats()`` for tests.
``store`` counts what the trace stores' write queues did (``count_store``): ``waits`` (a submit
waited for room: back-pressure) and ``wait_s`` (for how long in all), ``dropped`` (a full queue with
``on_full="drop"``, or a closed store), ``writer_restarts`` (a writer process that died, started
again), ``thread_fallbacks`` (a store that writes in a thread after its writer process failed).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Protocol

log = logging.getLogger("marft_bridge.capture")


class _Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.errors = 0
        self.by_where: Counter[str] = Counter()
        self.last: str | None = None
        self.store: Counter[str] = Counter()
        self.store_wait_s = 0.0


_STATS = _Stats()


class ErrorCounter(Protocol):
    """What the accounting needs of a recorder (``recording.EpisodeRecorder``, which imports this
    module): its own count, carried into the episode's metadata."""

    def count_error(self, msg: str) -> None: ...


def capture_error(where: str, exc: BaseException, recorder: ErrorCounter | None = None) -> None:
    """Log and count a failure inside capture code. Never raises.

    The first failure of each kind is logged with its traceback; repeats only every 1000th, so a
    persistent capture bug cannot flood the app's logs (the counts stay exact).
    """
    try:
        msg = f"{where}: {type(exc).__name__}: {exc}"
        with _STATS.lock:
            _STATS.errors += 1
            _STATS.by_where[where] += 1
            _STATS.last = msg
            n = _STATS.by_where[where]
        if recorder is not None:
            recorder.count_error(msg)
        if n == 1:
            log.warning("marft capture error (the app is unaffected) in %s", msg, exc_info=exc)
        elif n % 1000 == 0:
            log.warning("marft capture error in %s (%d so far; the app is unaffected)", msg, n)
    except Exception:  # noqa: BLE001 - the error path itself must never raise into the app
        pass


class guarded:  # noqa: N801 - used like a function: ``with guarded("where"):``
    """Run capture code; any exception is logged and counted instead of reaching the app.

    A class, not a ``@contextmanager`` generator: it runs several times per captured graph run.
    """

    __slots__ = ("where", "recorder")

    def __init__(self, where: str, recorder: ErrorCounter | None = None):
        self.where = where
        self.recorder = recorder

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> bool:
        if not isinstance(exc, Exception):
            return False  # BaseException (KeyboardInterrupt, SystemExit) still propagates
        capture_error(self.where, exc, self.recorder)
        return True


def count_store(what: str, seconds: float = 0.0) -> None:
    """Count one event of a trace store's write queue (see the module docstring)."""
    with _STATS.lock:
        _STATS.store[what] += 1
        _STATS.store_wait_s += seconds


def capture_stats() -> dict[str, Any]:
    with _STATS.lock:
        store = {k: _STATS.store[k] for k in ("waits", "dropped", "writer_restarts", "thread_fallbacks")}
        store["wait_s"] = _STATS.store_wait_s
        return {"errors": _STATS.errors, "by_where": dict(_STATS.by_where), "last": _STATS.last, "store": store}


def reset_capture_stats() -> None:
    with _STATS.lock:
        _STATS.errors = 0
        _STATS.by_where.clear()
        _STATS.last = None
        _STATS.store.clear()
        _STATS.store_wait_s = 0.0
