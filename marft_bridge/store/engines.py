"""The store's database connections and the write path's SQL, for SQLite and PostgreSQL.

``normalize_url`` turns what a user passes (nothing, a path, a URL) into a SQLAlchemy URL;
``create_engines`` makes the writer and reader engines (SQLite in WAL mode with our own BEGIN);
``write_sql`` compiles the write path's INSERTs once, run as driver SQL by ``sqlite_run``.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from ..errors import MarftError
from . import tables as t

DEFAULT_PATH = Path(".marft") / "traces.db"
# Key of the plain episode INSERT in ``write_sql``'s result (ids known to be new; SQLite group writes).
NEW_EPISODES = "new episodes"


def normalize_url(url: str | os.PathLike | None) -> str:
    """None -> the default SQLite file; a path -> SQLite file; ``postgresql://`` -> the psycopg driver."""
    if url is None:
        url = os.environ.get("MARFT_STORE") or DEFAULT_PATH
    if isinstance(url, os.PathLike) or "://" not in str(url):
        return "sqlite:///" + str(Path(url).expanduser().absolute())
    url = str(url)
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def create_engines(url: str) -> tuple[sa.Engine, sa.Engine]:
    """(writer, reader) engines. SQLite readers use plain deferred transactions in WAL mode; writers
    issue their own BEGIN IMMEDIATE (``WriteTransactions.begin``)."""
    try:
        u = sa.make_url(url)
    except sa.exc.ArgumentError:
        raise MarftError(f"not a store URL or path: {url!r}") from None
    if u.get_backend_name() not in ("sqlite", "postgresql"):
        raise MarftError(f"cannot use store URL {u.render_as_string(hide_password=True)}: the trace store runs on "
                         "SQLite (a path or sqlite:///...) or PostgreSQL (postgresql://...)")
    if u.get_backend_name() == "postgresql":
        try:
            engine = sa.create_engine(u, pool_pre_ping=True)
        except (ImportError, sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as e:
            raise MarftError(f"cannot use store URL {u.render_as_string(hide_password=True)}: {e}") from None
        return engine, engine
    if u.database in (None, "", ":memory:"):
        # The background writer and readers need connections of their own to one database.
        raise MarftError("an in-memory SQLite trace store is not supported; give a file path (a temporary one is fine)")
    try:
        Path(u.database).parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MarftError(f"cannot create the trace store directory for {u.database}: {e}") from None

    def make(begin: str | None) -> sa.Engine:
        engine = sa.create_engine(u, connect_args={"check_same_thread": False, "timeout": 30})

        @sa.event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below, or in WriteTransactions.begin)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        if begin is not None:
            @sa.event.listens_for(engine, "begin")
            def _on_begin(conn):
                conn.exec_driver_sql(begin)

        return engine

    # No "begin" hook on the writer: any engine-level event makes SQLAlchemy dispatch events around
    # every statement, which the ingest path would pay for on each insert.
    return make(None), make("BEGIN")


def write_sql(dialect: sa.Dialect, insert_new: sa.Insert) -> dict[sa.Table | str, str]:
    """The write path's INSERTs as driver SQL, compiled once from the table definitions.

    Run as driver SQL they skip SQLAlchemy's per-call statement compilation and parameter
    processing, which cost more than the inserts themselves. Parameters are named so
    the same row dicts feed SQLite (``:name``) and psycopg (``%(name)s``); ``insert_new`` is the
    episode insert that returns the id only when it is new.
    """
    if dialect.paramstyle == "qmark":
        dialect = type(dialect)(paramstyle="named")
    keys = {t.changes: ["episode_id", "kind", "created_at"]}  # seq is assigned by the database
    sql = {
        table: str(table.insert().compile(dialect=dialect, column_keys=keys.get(table), for_executemany=True))
        for table in (t.episode_agents, t.actions, t.rewards, t.changes)
    }
    sql[t.episodes] = str(insert_new.compile(dialect=dialect))
    sql[NEW_EPISODES] = str(t.episodes.insert().compile(dialect=dialect, for_executemany=True))
    return sql


def sqlite_run(conn: sa.Connection, sql: str, params: dict | list[dict] | None = None) -> Any:
    """Run driver SQL on the DBAPI cursor inside ``conn``'s transaction (a list of params: executemany).

    SQLAlchemy's per-statement bookkeeping costs more than a small SQLite insert, so the write path
    skips it; errors are wrapped as SQLAlchemy's, so retries and messages stay the same.
    """
    raw = conn.connection.driver_connection
    try:
        if isinstance(params, list):
            raw.executemany(sql, params)
            return None
        return raw.execute(sql, params or ()).fetchone()
    except sqlite3.Error as e:
        raise sa.exc.DBAPIError.instance(sql, params, e, sqlite3.Error) from e


def short_error(e: Exception) -> str:
    return str(getattr(e, "orig", None) or e).strip().splitlines()[0]
