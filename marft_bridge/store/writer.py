"""The background writer behind ``TraceStore.submit``: a bounded queue drained by one thread.

Capture hooks run inside the user's application; a slow disk or a bad record must neither block
nor crash it, so errors are logged and dead-lettered here and never raised into the caller.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any

from ..errors import RecordError

if TYPE_CHECKING:
    from .tracestore import TraceStore

log = logging.getLogger("marft_bridge.store")

_STOP = object()


class BackgroundWriter:
    def __init__(self, store: TraceStore, maxsize: int, on_full: str):
        self._store = store
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, maxsize))
        self._on_full = on_full
        self._pending = 0
        self._done = threading.Condition()
        self.dropped = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="marft-trace-writer", daemon=True)
        self._thread.start()
        # Episodes submitted just before the interpreter exits are still written.
        atexit.register(self.stop)

    def submit(self, episode: Any) -> None:
        item = _snapshot(episode)
        with self._done:
            if self._stopped:  # lost a race with close(): count it, never hang a later flush
                self.dropped += 1
                return
            self._pending += 1
        if self._on_full == "block":
            self._queue.put(item)
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._done:
                self._pending -= 1
                self.dropped += 1
                if self._pending == 0:
                    self._done.notify_all()
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("trace queue full: %d episode(s) dropped so far", self.dropped)

    def flush(self, timeout: float | None = None) -> bool:
        with self._done:
            return self._done.wait_for(lambda: self._pending == 0, timeout)

    def stop(self) -> None:
        atexit.unregister(self.stop)
        if self._thread.is_alive():
            self.flush()
            with self._done:
                self._stopped = True
            self._queue.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                self._store.add_episode(item)  # a refused record is dead-lettered there
            except RecordError as e:
                log.warning("trace refused: %s", e)
            except Exception:  # noqa: BLE001 - never let one bad write kill the writer thread
                log.exception("trace write failed")
            finally:
                with self._done:
                    self._pending -= 1
                    if self._pending == 0:  # flush() waits for zero; waking it per episode costs GIL handoffs
                        self._done.notify_all()


def _snapshot(episode: Any) -> Any:
    """A copy the caller may keep mutating: the dump of an Episode (cheap, done in Rust)."""
    from ..schema import Episode

    if isinstance(episode, Episode):
        try:
            return episode.model_dump()
        except Exception:  # noqa: BLE001 - the writer dead-letters what it cannot parse
            return repr(episode)
    return episode
