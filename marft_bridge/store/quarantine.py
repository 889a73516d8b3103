"""Stored episodes that cannot be read back, moved to the dead letters so reads go on without them.

The store validates what it writes, so such a row was written another way (by hand, by a tool, by
an older marft_bridge) or damaged. Each is moved in one transaction — its dead letter (the stored
JSON as it is, whole, and the reason) written and its rows deleted together, and the store's
count of quarantined episodes raised — so a crash leaves it either stored or moved, never both or
neither. ``scan`` is ``marft traces doctor``: every stored episode read, in chunks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa

from ..limits import RecordLimits
from . import tables as t
from .reads import QUARANTINED, READ_CHUNK, load_episodes, stored_document
from .records import DoctorReport, Finding
from .filters import EpisodeFilter
from .transactions import WriteTransactions


def quarantine_tx(conn: sa.Connection, writes: WriteTransactions, episode_id: str) -> bool:
    """Move one unreadable stored episode to the dead letters in ``conn``'s transaction; False
    when it is not stored (any more) or loads after all (another reader moved or a writer replaced it)."""
    if conn.execute(writes.lock_episode(episode_id)).first() is None:
        return False
    found, bad = load_episodes(conn, [episode_id])
    if found or not bad:
        return False
    conn.execute(t.dead_letters.insert().values(
        record=f"stored episode {episode_id}", field=None,
        reason=f"cannot be read back from the store, moved here: {bad[0].reason}",
        raw=stored_document(conn, episode_id), created_at=time.time()))
    for table in (t.rewards, t.actions, t.episode_agents):
        conn.execute(table.delete().where(table.c.episode_id == episode_id))
    conn.execute(t.episodes.delete().where(t.episodes.c.id == episode_id))
    q = sa.select(t.meta.c.value).where(t.meta.c.key == QUARANTINED)
    row = conn.execute(q.with_for_update() if writes.is_postgres else q).first()
    if row is None:  # two first quarantines racing on PostgreSQL: one retries (unique key) and updates
        conn.execute(t.meta.insert().values(key=QUARANTINED, value="1"))
    else:
        conn.execute(t.meta.update().where(t.meta.c.key == QUARANTINED).values(value=str(int(row.value) + 1)))
    return True


def scan(reader: sa.Engine, limits: RecordLimits, quarantine: Callable[[list[Finding]], int] | None,
         progress: Callable[[int, int], None] | None = None) -> DoctorReport:
    """Read every stored episode (oldest first, READ_CHUNK at a time) against ``limits``.

    One that does not load is unreadable: listed, and passed to ``quarantine`` (None: a dry run).
    One that loads but is past ``limits`` (written under higher ones) is listed and kept.
    ``progress(done, total)`` is called after each chunk.
    """
    with reader.connect() as conn:
        ids = list(conn.execute(EpisodeFilter().select(t.episodes.c.id)).scalars())
    report = DoctorReport(dry_run=quarantine is None)
    for start in range(0, len(ids), READ_CHUNK):
        chunk = ids[start:start + READ_CHUNK]
        bad: list[Finding] = []
        with reader.connect() as conn:
            _, failed = load_episodes(conn, chunk, limits)
            for f in failed:
                readable, unreadable = load_episodes(conn, [f.episode_id])
                if readable:
                    report.over_limits.append(f)
                bad += unreadable
        report.scanned += len(chunk)
        report.unreadable += bad
        if bad and quarantine is not None:
            report.quarantined += quarantine(bad)
        if progress is not None:
            progress(report.scanned, len(ids))
    return report
