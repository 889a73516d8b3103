"""The store's read queries, each on a connection the caller opened: whole episodes spliced from
their stored JSON pieces, summary rows, counts, dead letters and the change log."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError

from ..limits import RecordLimits
from ..schema import STORED, Episode, record_error
from . import tables as t
from .records import DeadLetter, Finding
from .filters import EpisodeFilter
from .rows import from_epoch

# Ids per IN (...) query: keeps statements and the episodes loaded at once small.
READ_CHUNK = 200
# marft_meta key of the count of quarantined episodes (moved to the dead letters, unreadable).
QUARANTINED = "quarantined"


def load_episodes(conn: sa.Connection, ids: list[str],
                  limits: RecordLimits | None = None) -> tuple[list[Episode], list[Finding]]:
    """Episodes for ``ids`` (in that order; missing ids are skipped), and those that cannot be read
    back, each with the reason. Stored episodes were checked against the record limits when written;
    ``limits`` checks them again (``doctor`` does, to find what is past lowered limits)."""
    if not ids:
        return [], []
    heads, parts, bad = _pieces(conn, ids)
    context = STORED if limits is None else {"limits": limits}
    found: list[Episode] = []
    for i in ids:
        if i not in heads:
            continue
        try:
            # The stored JSON pieces are spliced into one document and parsed once (in Rust).
            found.append(Episode.model_validate_json(_document(heads[i], *parts[i]), context=context))
        except MemoryError:
            raise
        except ValidationError as e:
            bad.append(Finding(episode_id=i, reason=str(record_error(e, None))))
        except Exception as e:  # noqa: BLE001 - whatever stops a stored row from loading
            bad.append(Finding(episode_id=i, reason=f"{type(e).__name__}: {e}"))
    return found, bad


def stored_document(conn: sa.Connection, episode_id: str) -> str | None:
    """The stored episode as one JSON document, as it is (text that is not UTF-8 decoded with
    replacement characters), whether or not it loads; None when it is not stored."""
    try:
        heads, parts, _ = _pieces(conn, [episode_id], strict=True)
    except sa.exc.OperationalError as e:
        if not _not_text(e):
            raise
        heads, parts, _ = _pieces(conn, [episode_id], strict=True, as_bytes=True)
    return _document(heads[episode_id], *parts[episode_id]) if episode_id in heads else None


def _document(head: str, actions: list[str], rewards: list[str]) -> str:
    return f'{head[:-1]},"actions":[{",".join(actions)}],"rewards":[{",".join(rewards)}]}}'


def _not_text(e: sa.exc.DBAPIError) -> bool:
    return "decode" in str(e.orig)  # SQLite: "Could not decode to UTF-8 column 'body' ..."


def _pieces(conn: sa.Connection, ids: list[str], strict: bool = False, as_bytes: bool = False):
    """(head body per id, (action bodies, reward bodies) per id, Findings). SQLite holds whatever
    bytes were written; a chunk whose rows are not all UTF-8 text is read id by id, and an id
    that still fails is a Finding (``strict``: the error is raised instead)."""
    try:
        return (*_query_pieces(conn, ids, as_bytes), [])
    except sa.exc.OperationalError as e:
        if strict or not _not_text(e):
            raise
    heads: dict[str, str] = {}
    parts: dict[str, tuple[list[str], list[str]]] = {}
    bad: list[Finding] = []
    for i in ids:
        try:
            h, p = _query_pieces(conn, [i], False)
        except sa.exc.OperationalError as e:
            if not _not_text(e):
                raise
            bad.append(Finding(episode_id=i, reason="a stored row is not UTF-8 text"))
            continue
        heads.update(h)
        parts.update(p)
    return heads, parts, bad


def _query_pieces(conn: sa.Connection, ids: list[str], as_bytes: bool):
    def body(table: sa.Table):
        return sa.cast(table.c.body, sa.LargeBinary) if as_bytes else table.c.body

    def text(x):
        return x.decode("utf-8", "replace") if isinstance(x, bytes) else x

    heads = {i: text(b) for i, b in conn.execute(
        sa.select(t.episodes.c.id, body(t.episodes)).where(t.episodes.c.id.in_(ids)))}
    parts: dict[str, tuple[list[str], list[str]]] = {i: ([], []) for i in heads}
    for k, table in enumerate((t.actions, t.rewards)):
        for eid, b in conn.execute(
            sa.select(table.c.episode_id, body(table)).where(table.c.episode_id.in_(ids))
            .order_by(table.c.episode_id, table.c.seq)
        ):
            if eid in parts:
                parts[eid][k].append(text(b))
    return heads, parts


def stored_size(conn: sa.Connection, episode_id: str) -> int:
    """The UTF-8 length of a stored episode's JSON bodies (what ``Rows.size`` counts of a new one)."""
    if conn.dialect.name == "postgresql":
        length = sa.func.octet_length
    else:
        def length(col):
            return sa.func.length(sa.cast(col, sa.LargeBinary))
    total = 0
    for table, col in ((t.episodes, t.episodes.c.id), (t.actions, t.actions.c.episode_id),
                       (t.rewards, t.rewards.c.episode_id)):
        total += int(conn.execute(sa.select(sa.func.coalesce(sa.func.sum(length(table.c.body) + 1), 0))
                                  .where(col == episode_id)).scalar_one())
    return total


def summary_rows(conn: sa.Connection, where: EpisodeFilter) -> list[dict]:
    """Summary rows (id, source, status, times, counts, agents) of the episodes ``where`` lists."""
    e = t.episodes.c
    cols = [e.id, e.source, e.status, e.started_at, e.ended_at, e.n_actions, e.n_rewards]
    rows = [dict(r._mapping) for r in conn.execute(where.select(*cols))]
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


def store_stats(conn: sa.Connection, url: str, dropped: int, skipped: int) -> dict[str, Any]:
    """Counts from the tables; ``url``, ``dropped`` and ``skipped`` (unreadable episodes this store
    object passed over) are the store's own."""
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
        "quarantined": quarantined_count(conn),
        "unreadable_skipped": skipped,
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


def dead_letter_list(conn: sa.Connection, limit: int | None, raw_chars: int | None = None) -> list[DeadLetter]:
    """Refused records, newest first; ``raw_chars``: only the first that many characters of each raw
    record are read (a quarantined episode is kept whole, and may be large)."""
    d = t.dead_letters.c
    raw = d.raw if raw_chars is None else sa.func.substr(d.raw, 1, raw_chars).label("raw")
    q = sa.select(d.seq, d.record, d.field, d.reason, raw, d.created_at).order_by(d.seq.desc())
    if limit is not None:
        q = q.limit(limit)
    return [
        DeadLetter(seq=r.seq, record=r.record, field=r.field, reason=r.reason, raw=r.raw,
                   created_at=from_epoch(r.created_at))
        for r in conn.execute(q)
    ]


def quarantined_count(conn: sa.Connection) -> int:
    """How many stored episodes were found unreadable and moved to the dead letters, ever."""
    row = conn.execute(sa.select(t.meta.c.value).where(t.meta.c.key == QUARANTINED)).first()
    return int(row.value) if row is not None else 0


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
