"""Write transactions on the store's database and the statements the write path runs in them.

SQLite takes its write lock at BEGIN (IMMEDIATE); a transaction that loses a race is retried
whole. The INSERTs are compiled once (``engines.write_sql``) and run as driver SQL.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa

from ..errors import MarftError, RecordError
from . import tables as t
from .engines import short_error, sqlite_run, write_sql
from .rows import Rows, reward_row

if TYPE_CHECKING:
    from ..schema import Reward

T = TypeVar("T")


class WriteTransactions:
    """Write transactions on one engine (SQLite or PostgreSQL) and the inserts and locks run in them."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine
        self.is_postgres = engine.dialect.name == "postgresql"
        # A new id inserts (and returns it); an existing one returns nothing and is merged instead.
        dialect = importlib.import_module(f"sqlalchemy.dialects.{'postgresql' if self.is_postgres else 'sqlite'}")
        insert_new = dialect.insert(t.episodes).on_conflict_do_nothing(index_elements=["id"]).returning(t.episodes.c.id)
        self._sql = write_sql(engine.dialect, insert_new)

    @contextlib.contextmanager
    def begin(self) -> Iterator[sa.Connection]:
        """A write transaction. SQLite takes the write lock at BEGIN (IMMEDIATE) so concurrent
        merges cannot deadlock on a lock upgrade."""
        with self.engine.begin() as conn:
            if not self.is_postgres:
                sqlite_run(conn, "BEGIN IMMEDIATE")
            yield conn

    def retry(self, fn: Callable[[sa.Connection], T]) -> T:
        """Run ``fn`` in a write transaction, retrying the whole transaction when it loses a race;
        returns what ``fn`` returned in the transaction that committed."""
        # A concurrent writer may insert the same new episode id first (PostgreSQL unique violation)
        # or hold the SQLite lock past busy_timeout: retry the whole transaction, which then merges.
        for attempt in range(5):
            try:
                with self.begin() as conn:
                    result = fn(conn)
                return result
            except (sa.exc.IntegrityError, sa.exc.OperationalError) as e:
                if attempt == 4:
                    raise MarftError(f"trace store write failed: {short_error(e)}") from None
                time.sleep(0.05 * (attempt + 1))

    def insert(self, conn: sa.Connection, table: sa.Table | str, params: dict | list[dict]) -> Any:
        """Run one of the write path's INSERTs; returns the first row a single insert RETURNs."""
        if self.is_postgres:  # through SQLAlchemy, which also notices a dropped server connection
            result = conn.exec_driver_sql(self._sql[table], params)
            return result.first() if result.returns_rows else None
        return sqlite_run(conn, self._sql[table], params)

    def insert_children(self, conn: sa.Connection, rows: Rows) -> None:
        """An episode write's agent, action and reward rows."""
        for table, batch in ((t.episode_agents, rows.agents), (t.actions, rows.actions), (t.rewards, rows.rewards)):
            if batch:
                self.insert(conn, table, batch)

    def log_change(self, conn: sa.Connection, episode_id: str, kind: str) -> None:
        self.log_changes(conn, [{"episode_id": episode_id, "kind": kind, "created_at": time.time()}])

    def log_changes(self, conn: sa.Connection, rows: list[dict]) -> None:
        if self.is_postgres:
            # Sequence numbers are handed out at insert but become visible at commit; holding this
            # lock to commit makes the visible order the seq order, so a poller never skips one.
            conn.execute(sa.text(f"lock table {t.changes.name} in exclusive mode"))
        self.insert(conn, t.changes, rows if len(rows) > 1 else rows[0])

    def lock_episode(self, episode_id: str) -> sa.Select:
        """SELECT of a stored episode's id and counts, locking its row on PostgreSQL."""
        q = sa.select(t.episodes.c.id, t.episodes.c.n_actions, t.episodes.c.n_rewards).where(t.episodes.c.id == episode_id)
        return q.with_for_update() if self.is_postgres else q

    def insert_reward(self, conn: sa.Connection, episode_id: str, reward: Reward) -> None:
        """A late reward on a stored episode (its agent or action must be stored too; else RecordError)."""
        name = f"episode {episode_id}"
        row = conn.execute(self.lock_episode(episode_id)).first()
        if row is None:
            raise RecordError(name, None, "no such episode in the store")
        if reward.agent is not None:
            known = conn.execute(sa.select(t.episode_agents.c.agent).where(
                t.episode_agents.c.episode_id == episode_id, t.episode_agents.c.agent == reward.agent)).first()
            if known is None:
                raise RecordError(name, "reward.agent", f"unknown agent {reward.agent!r}")
        if reward.action_id is not None:
            known = conn.execute(sa.select(t.actions.c.seq).where(
                t.actions.c.episode_id == episode_id, t.actions.c.id == reward.action_id)).first()
            if known is None:
                raise RecordError(name, "reward.action_id", f"unknown action id {reward.action_id!r}")
        self.insert(conn, t.rewards, [reward_row(episode_id, row.n_rewards, reward)])
        conn.execute(t.episodes.update().where(t.episodes.c.id == episode_id).values(n_rewards=row.n_rewards + 1))
        self.log_change(conn, episode_id, "reward")
