"""The background writer behind ``TraceStore.submit``: a bounded queue drained by one thread.

Capture hooks run inside the user's application; a slow disk or a bad record must neither block
nor crash it, so errors are logged and dead-lettered here and never raised into the caller.

The thread hands groups to the ``write`` callback it was given: the store's group commit (several
episodes per transaction) in this thread, or ``writer_process.ProcessSink``, which sends each group
to a writer process and waits for it to be committed there; it knows nothing else of the store.
``copy`` copies each episode at ``submit`` (here: pickle for dicts, JSON for Episodes; the
process sink: JSON bytes for both). At most ``maxsize`` episodes wait in the queue, besides the
group being written: a full queue makes ``submit`` wait ("block") or drop and count ("drop"); both
are counted in ``capture_stats()["store"]``.
Once an episode arrives it waits up to ``linger`` seconds for more before writing them all, so
under load it wakes, takes the GIL and commits once per group instead of once per episode; a
``flush()``, ``close()`` or a full queue ends the wait at once.
"""

from __future__ import annotations

import atexit
import logging
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..capture_errors import count_store

log = logging.getLogger("marft_bridge.store")

LINGER_S = 0.1  # a queued episode reaches readers at most this much later (flush() skips the wait)
MAX_GROUP = 500  # episodes per transaction: keeps other writers' waits for the lock short


class BackgroundWriter:
    def __init__(self, write: Callable[[list[Any]], None], maxsize: int, on_full: str, linger: float = LINGER_S,
                 copy: Callable[[Any], Any] | None = None, on_stop: Callable[[], None] | None = None):
        self._write = write  # writes one group; expected to log and dead-letter, not raise
        self._copy = copy or snapshot
        self._on_stop = on_stop  # run once the thread has written everything and ended
        self._items: deque = deque()
        self._maxsize = max(1, maxsize)
        self._on_full = on_full
        self._linger = linger
        lock = threading.Lock()
        self._has_items = threading.Condition(lock)  # the writer waits for work here
        self._not_full = threading.Condition(lock)  # blocked submitters wait here
        self._done = threading.Condition(lock)  # flush() waits here
        self._pending = 0  # queued + being written
        self._urgent = False  # flush/stop/full: write now, do not linger
        self._idle = False  # the writer waits for a first item (submit must wake it)
        self._stopped = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="marft-trace-writer", daemon=True)
        self._thread.start()
        # Episodes submitted just before the interpreter exits are still written.
        atexit.register(self.stop)

    def submit(self, episode: Any, *copy_args: Any) -> None:
        item = self._copy(episode, *copy_args)
        waited = None  # when the app started waiting for room (back-pressure)
        dropped = 0
        with self._has_items:
            while not self._stopped and len(self._items) >= self._maxsize:
                self._urgent = True  # the writer stops lingering and drains
                self._has_items.notify()
                if self._on_full == "drop":
                    break
                waited = time.perf_counter() if waited is None else waited
                self._not_full.wait()
            if self._stopped or len(self._items) >= self._maxsize:
                # Full with on_full="drop", or lost a race with close(): count it, never hang a later flush.
                self.dropped += 1
                dropped = self.dropped
            else:
                self._items.append(item)
                self._pending += 1
                if self._idle:
                    self._idle = False
                    self._has_items.notify()
        if waited is not None:
            count_store("waits", seconds=time.perf_counter() - waited)
        if dropped:
            count_store("dropped")
            if dropped == 1 or dropped % 1000 == 0:
                log.warning("trace queue full: %d episode(s) dropped so far", dropped)

    @property
    def queued(self) -> int:
        """Episodes waiting in the queue (not those of the group being written)."""
        with self._has_items:
            return len(self._items)

    @property
    def pending(self) -> int:
        """Episodes queued or being written."""
        with self._has_items:
            return self._pending

    def flush(self, timeout: float | None = None) -> bool:
        with self._done:
            if self._pending:
                self._urgent = True
                self._has_items.notify()
            return self._done.wait_for(lambda: self._pending == 0, timeout)

    def stop(self) -> None:
        atexit.unregister(self.stop)
        if self._thread.is_alive():
            self.flush()
            with self._has_items:
                self._stopped = True
                self._has_items.notify()
                self._not_full.notify_all()  # blocked submitters count their episode as dropped
            self._thread.join()
        on_stop, self._on_stop = self._on_stop, None
        if on_stop is not None:
            on_stop()

    def _take(self) -> list[Any] | None:
        """The next group to write (None: stopped), after lingering for more."""
        with self._has_items:
            while not self._items:
                if self._stopped:
                    return None
                self._idle, self._urgent = True, False
                self._has_items.wait()
            self._idle = False
            if not self._urgent and len(self._items) < MAX_GROUP:
                self._has_items.wait_for(lambda: self._urgent or self._stopped, self._linger)
            group = [self._items.popleft() for _ in range(min(len(self._items), MAX_GROUP))]
            self._urgent = bool(self._items) and self._urgent
            self._not_full.notify_all()
            return group

    def _run(self) -> None:
        while (group := self._take()) is not None:
            try:
                self._write(group)
            except Exception:  # noqa: BLE001 - never let a bug here kill the writer thread
                log.exception("trace write failed")
            finally:
                with self._done:
                    self._pending -= len(group)
                    if self._pending == 0:  # flush() waits for zero; waking it per episode costs GIL handoffs
                        self._done.notify_all()


class Snapshot:
    """A queued episode record as pickle bytes, made here from the caller's own object.

    Bytes are a true copy (the caller may keep mutating its dicts) and keep the queue out of the
    cyclic GC's way: queued dicts are thousands of containers that survive young collections and
    trigger full ones, which cost the app more than the writes themselves. Pickle, unlike JSON,
    gives back exactly the objects given (non-string keys, datetimes, UUIDs), so the writer
    validates and refuses exactly what ``add_episode`` would. These bytes never leave the process:
    nothing from a file or the network is ever unpickled.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def load(self) -> Any:
        return pickle.loads(self.data)


def unqueued(item: Any) -> Any:
    """A queued record as submitted (the thread's queue holds dicts as pickle snapshots)."""
    return item.load() if isinstance(item, Snapshot) else item


def snapshot(episode: Any) -> Any:
    from ..schema import Episode

    if isinstance(episode, Episode):
        try:
            return Episode.__pydantic_serializer__.to_json(episode)  # JSON: add_episode parses it in one pass
        except Exception:  # noqa: BLE001 - the writer dead-letters what it cannot parse
            return repr(episode)
    if isinstance(episode, dict):
        try:
            return Snapshot(pickle.dumps(episode, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:  # noqa: BLE001 - not picklable: queued as it is; the writer judges it
            return episode
    return episode
