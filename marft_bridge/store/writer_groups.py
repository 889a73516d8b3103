"""The store's group commit: what its background writers (``writer.py``, a thread; ``writer_process.py``,
a process) call with a group of queued episodes (``TraceStore.write_queued``). A collaborator of the
store, built with what it needs of it as explicit callables (validating, adding one episode alone,
dead-lettering, merging a half in a transaction), and ``validated_rows``, the validation it shares
with ``TraceStore.add_episode``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError

from ..errors import MarftError, RecordError
from ..limits import RecordLimits
from ..schema import STORED, Episode, parse_episode
from . import tables as t
from .engines import NEW_EPISODES
from .rows import Rows, episode_rows
from .transactions import WriteTransactions
from .writer import unqueued

log = logging.getLogger("marft_bridge.store")


def validated_rows(data: dict | bytes | str, limits: RecordLimits) -> tuple[Episode, Rows]:
    """``data`` (a dict, or JSON text: a submitted Episode is queued as JSON, parsed and validated
    in one pass in Rust) as an Episode and its rows; RecordError or ValidationError if refused.
    The record limits are judged on the rows' JSON (``Rows.fields_within``); an episode past one,
    or whose rows cannot be made, is validated again by the record model, so it is refused as
    without a store, naming the field. One that breaks an invariant is refused at once."""
    def validate(check_fields: bool) -> Episode:
        if isinstance(data, dict):
            return parse_episode(data, limits=limits, check_fields=check_fields)
        return Episode.model_validate_json(data, context={"limits": limits} if check_fields else STORED)

    ep = validate(False)
    try:
        rows = episode_rows(ep, limits=limits)
        if rows.fields_within:
            return ep, rows
    except RecordError:  # not JSON, or too big: a field past a limit, if there is one, is the reason
        pass
    ep = validate(True)
    return ep, episode_rows(ep, limits=limits)


# What the group commit calls on the store: validate a queued item's data into rows, add one item
# alone (refusals dead-lettered there), dead-letter a record, merge a half into a stored episode.
Validate = Callable[[dict | bytes | str], tuple[Episode, Rows]]
ToData = Callable[[Any], dict]
AddOne = Callable[[Any], Any]
DeadLetter = Callable[[RecordError, Any], None]
MergeTx = Callable[[sa.Connection, str, dict], bool]


class GroupCommit:
    """``write_queued`` and its steps, on the store's write transactions and the callables it is given."""

    def __init__(self, writes: WriteTransactions, *, validate: Validate, to_data: ToData, add_one: AddOne,
                 dead_letter: DeadLetter, merge_tx: MergeTx):
        self._writes = writes
        self._validate, self._to_data, self._add_one = validate, to_data, add_one
        self._dead_letter, self._merge_tx = dead_letter, merge_tx

    def write_queued(self, items: list[Any]) -> None:
        """The background writers' group commit: write queued episodes, several per transaction.

        Each episode is still all-or-nothing: all are validated first, one at a time; a run of
        valid ones is written in one transaction (one commit instead of one per episode, the main
        cost of small writes), and one that does not validate alone (refused and dead-lettered,
        or a half that needs the stored half) goes through ``add_one`` (``add_episode``) in its place in the
        order. If a group's transaction fails, its episodes are written one by one, so a bad one
        cannot take valid ones down with it. Errors are logged, never raised.
        """
        # The group keeps the queued snapshots (bytes), not the loaded dicts nor the validated
        # Episodes: thousands of live containers would set off the cyclic GC in the app's time.
        group: list[tuple[str, Rows, Any]] = []
        for item in items:
            try:
                data = unqueued(item)
                ep, rows = self._validate(data if isinstance(data, (bytes, str)) else self._to_data(data))
                group.append((ep.id, rows, item))
            except (RecordError, ValidationError):
                self._write_group(group)
                group = []
                self._write_one(item)
            except Exception as e:  # noqa: BLE001 - a snapshot that cannot be loaded back
                self._write_group(group)
                group = []
                self._dead_letter(RecordError(None, None, f"cannot be read back from the write queue: {e}"), item)
        self._write_group(group)

    def _write_group(self, group: list[tuple[str, Rows, Any]]) -> None:
        if not group:
            return
        try:
            self._writes.retry(lambda conn: self._write_new_episodes(conn, group))
            return
        except Exception as e:  # noqa: BLE001 - e.g. a merge that does not validate: one by one
            log.info("group write of %d episode(s) failed (%s); writing them one by one", len(group), e)
        for _, _, item in group:
            self._write_one(item)

    def _write_one(self, item: Any) -> None:
        try:
            self._add_one(unqueued(item))  # a refused record is dead-lettered there
        except RecordError as e:
            log.warning("trace refused: %s", e)
        except Exception:  # noqa: BLE001 - never let one bad write stop the writer
            log.exception("trace write failed")

    def _write_new_episodes(self, conn: sa.Connection, group: list[tuple[str, Rows, Any]]) -> None:
        """Validated episodes in one transaction, rows of new episodes in one executemany per table;
        an id already stored (or earlier in the group) is merged in its place in the order.

        SQLite holds the write lock from BEGIN, so one query finds the stored ids up front; each
        SQLite call releases the GIL, and a call per episode would hand it to the app every time.
        PostgreSQL inserts each episode on its own (ON CONFLICT), as concurrent writers may race.
        """
        stored: set[str] = set()
        if not self._writes.is_postgres:
            ids = list({eid for eid, _, _ in group})
            stored = {r[0] for r in conn.execute(sa.select(t.episodes.c.id).where(t.episodes.c.id.in_(ids)))}
        batch = Rows([], [], [], [])
        changes: list[dict] = []

        def write_batch() -> None:
            if batch.episode:
                self._writes.insert(conn, NEW_EPISODES, batch.episode)
            self._writes.insert_children(conn, batch)
            if changes:
                self._writes.log_changes(conn, changes)
            batch.episode, batch.agents, batch.actions, batch.rewards = [], [], [], []
            changes.clear()

        now = time.time()
        for eid, rows, item in group:
            if self._writes.is_postgres:
                new = self._writes.insert(conn, t.episodes, rows.episode) is not None
            else:
                new = eid not in stored
                if new:
                    batch.episode.append(rows.episode)
                    stored.add(eid)
            if new:
                batch.agents += rows.agents
                batch.actions += rows.actions
                batch.rewards += rows.rewards
                changes.append({"episode_id": eid, "kind": "add", "created_at": now})
                continue
            write_batch()  # the merge reads the stored episode: everything before it is written first
            if not self._merge_tx(conn, eid, self._to_data(unqueued(item))):
                raise MarftError(f"episode {eid} is neither new nor stored")
        write_batch()
