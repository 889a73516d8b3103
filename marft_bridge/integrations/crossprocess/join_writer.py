"""Writing callee halves into the store once their caller's call step is there (propagation.py's
module docstring says why the callee writes second): one background writer per store object
(``propagation.join_writer(store)`` keeps them)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ...capture_errors import capture_error
from ...errors import RecordError
from ...seams import EpisodeSink

log = logging.getLogger("marft_bridge.capture")


class JoinWriter:
    """Writes callee halves once the caller's call step is stored (background thread)."""

    def __init__(self, store: EpisodeSink, join_timeout: float = 120.0, poll: float = 0.1, idle_exit: float = 5.0):
        self.store = store
        self.join_timeout = join_timeout
        self.poll = poll
        self.idle_exit = idle_exit
        self._cond = threading.Condition()
        self._pending: list[tuple[float, dict, str | None]] = []
        self._busy = 0
        self._thread: threading.Thread | None = None
        self.written = 0
        self.unresolved = 0

    def write(self, data: dict, caller_action: str | None) -> None:
        with self._cond:
            self._pending.append((time.monotonic() + self.join_timeout, data, caller_action))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="marft-join-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every half given so far is written (joined, or unresolved after its timeout)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(self.poll if left is None else min(left, self.poll))
        return True

    def _stored_ids(self, episode_id: str) -> set[str]:
        self.store.flush()  # a caller in this process may still hold its half in the store's queue
        return self.store.action_ids(episode_id)  # one indexed query, the episode is not loaded

    def _run(self) -> None:
        while True:
            with self._cond:
                # Stay a while when idle: a server writes a half per request.
                idle_end = time.monotonic() + self.idle_exit
                while not self._pending:
                    left = idle_end - time.monotonic()
                    if left <= 0:
                        self._thread = None
                        self._cond.notify_all()
                        return
                    self._cond.wait(left)
                batch, self._pending = self._pending, []
                self._busy += 1
            later: list = []
            try:
                by_episode: dict[str, list] = {}
                for item in batch:
                    by_episode.setdefault(item[1]["id"], []).append(item)
                for eid, items in by_episode.items():
                    later += self._write_episode(eid, items)
            finally:
                with self._cond:
                    self._pending[:0] = later
                    self._busy -= 1
                    self._cond.notify_all()
            if later:
                time.sleep(self.poll)

    def _write_episode(self, eid: str, items: list) -> list:
        """Write the halves of one episode that can be joined now, in one transaction; return the rest."""
        try:
            known = self._stored_ids(eid) if any(c is not None for _, _, c in items) else set()
            stored = bool(known)
            ready, later, now = [], [], time.monotonic()
            for item in items:
                deadline, data, caller = item
                if caller is not None and caller not in known:
                    if now < deadline:
                        later.append(item)
                        continue
                    data = _without_caller(data, caller)
                    self.unresolved += 1
                ready.append(data)
                known.update(a["id"] for a in data["actions"])
            if ready:
                self._add(combine_halves(ready), stored)
                self.written += len(ready)
            return later
        except Exception as e:  # noqa: BLE001 - e.g. the database is busy: try again until the deadline
            capture_error("join.write", e)
            return [it for it in items if time.monotonic() < it[0]]

    def _add(self, data: dict, stored: bool) -> None:
        if stored or self.store.has_episode(data["id"]):
            # The caller's half owns the episode's task, status and times; a callee half adds actions.
            for key in ("status", "ended_at", "task"):
                data[key] = None
        try:
            self.store.add_episode(data)
        except RecordError as e:  # refused and dead-lettered by the store; the app is unaffected
            capture_error("join.add_episode", e)


def combine_halves(halves: list[dict]) -> dict:
    """Several halves of one episode as one record (one merge in the store instead of several)."""
    if len(halves) == 1:
        return halves[0]
    out = dict(halves[0])
    out["actions"] = [a for h in halves for a in h["actions"]]
    out["rewards"] = [r for h in halves for r in h.get("rewards") or ()]
    out["metadata"] = {k: v for h in halves for k, v in (h.get("metadata") or {}).items()}
    return out


def _without_caller(data: dict, caller_action: str) -> dict:
    acts = data["actions"]
    acts[0]["depends_on"] = [d for d in acts[0]["depends_on"] if d != caller_action]
    data["metadata"] = {**(data.get("metadata") or {}), "unresolved_caller": caller_action}
    log.warning("marft: caller action %s of episode %s was not stored in time; its callee half is written "
                "without that dependency", caller_action, data["id"])
    return data
