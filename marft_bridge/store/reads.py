"""The store's read queries, each on a connection the caller opened: whole episodes spliced from
their stored JSON pieces, summary rows, counts, dead letters and the change log."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..schema import Episode
from . import tables as t
from .records import DeadLetter
from .rows import from_epoch, listing

# Ids per IN (...) query: keeps statements and the episodes loaded at once small.
READ_CHUNK = 200


def load_episodes(conn: sa.Connection, ids: list[str]) -> list[Episode]:
    """Episodes for ``ids`` (in that order; missing ids are skipped)."""
    if not ids:
        return []
    heads = dict(conn.execute(sa.select(t.episodes.c.id, t.episodes.c.body).where(t.episodes.c.id.in_(ids))).all())
    parts: dict[str, tuple[list[str], list[str]]] = {i: ([], []) for i in heads}
    for k, table in enumerate((t.actions, t.rewards)):
        for eid, body in conn.execute(
            sa.select(table.c.episode_id, table.c.body).where(table.c.episode_id.in_(ids))
            .order_by(table.c.episode_id, table.c.seq)
        ):
            parts[eid][k].append(body)
    # The stored JSON pieces are spliced into one document and parsed once (in Rust).
    return [
        Episode.model_validate_json(
            f'{heads[i][:-1]},"actions":[{",".join(parts[i][0])}],"rewards":[{",".join(parts[i][1])}]}}')
        for i in ids if i in heads
    ]


def summary_rows(conn: sa.Connection, where: list, limit: int | None, newest_first: bool) -> list[dict]:
    """Summary rows (id, source, status, times, counts, agents) of the listed episodes."""
    e = t.episodes.c
    cols = [e.id, e.source, e.status, e.started_at, e.ended_at, e.n_actions, e.n_rewards]
    rows = [dict(r._mapping) for r in conn.execute(listing(cols, where, limit, newest_first))]
    ids = [r["id"] for r in rows]
    agents: dict[str, list[str]] = {}
    for i in range(0, len(ids), READ_CHUNK):
        for eid, agent in conn.execute(
            sa.select(t.episode_agents.c.episode_id, t.episode_agents.c.agent).where(
                t.episode_agents.c.episode_id.in_(ids[i : i + READ_CHUNK]))
        ):
            agents.setdefault(eid, []).append(agent)
    for r in rows:
        r["agents"] = sorted(agents.get(r["id"], []))
    return rows


def store_stats(conn: sa.Connection, url: str, dropped: int) -> dict[str, Any]:
    """Counts from the tables; ``url`` and ``dropped`` (the store's own) take their places among them."""
    e, a = t.episodes.c, t.actions.c

    def n(table: sa.Table) -> int:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())

    out: dict[str, Any] = {
        "url": url,
        "episodes": n(t.episodes),
        "actions": n(t.actions),
        "rewards": n(t.rewards),
        "dead_letters": n(t.dead_letters),
        "episodes_with_reward": int(conn.execute(sa.select(sa.func.count()).where(e.n_rewards > 0)).scalar_one()),
        "dropped": dropped,
    }
    lo, hi = conn.execute(sa.select(sa.func.min(e.started_at), sa.func.max(e.started_at))).one()
    out["first_started_at"] = from_epoch(lo)
    out["last_started_at"] = from_epoch(hi)
    out["sources"] = {s: int(c) for s, c in conn.execute(
        sa.select(e.source, sa.func.count()).group_by(e.source).order_by(e.source))}
    agents: dict[str, dict[str, int]] = {}
    for name, c in conn.execute(sa.select(t.episode_agents.c.agent, sa.func.count()).group_by(t.episode_agents.c.agent)):
        agents[name] = {"episodes": int(c), "actions": 0}
    for name, c in conn.execute(sa.select(a.agent, sa.func.count()).group_by(a.agent)):
        agents.setdefault(name, {"episodes": 0, "actions": 0})["actions"] = int(c)
    out["agents"] = dict(sorted(agents.items()))
    return out


def dead_letter_list(conn: sa.Connection, limit: int | None) -> list[DeadLetter]:
    """Refused records, newest first."""
    q = sa.select(t.dead_letters).order_by(t.dead_letters.c.seq.desc())
    if limit is not None:
        q = q.limit(limit)
    return [
        DeadLetter(seq=r.seq, record=r.record, field=r.field, reason=r.reason, raw=r.raw,
                   created_at=from_epoch(r.created_at))
        for r in conn.execute(q)
    ]


def change_cursor(conn: sa.Connection) -> int:
    """The last seq of the change log (0 when it is empty)."""
    return int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(t.changes.c.seq), 0))).scalar_one())


def changes_after(conn: sa.Connection, cursor: int, limit: int | None) -> tuple[int, list[str]]:
    """(new cursor, ids in order of change) of the change log's rows after ``cursor``."""
    q = sa.select(t.changes.c.seq, t.changes.c.episode_id).where(t.changes.c.seq > cursor).order_by(t.changes.c.seq)
    if limit is not None:
        q = q.limit(limit)
    rows = conn.execute(q).all()
    if not rows:
        return cursor, []
    return rows[-1].seq, list(dict.fromkeys(r.episode_id for r in rows))
