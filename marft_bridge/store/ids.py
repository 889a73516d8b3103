"""Episode ids by unique prefix, as git and docker take them: ``marft traces list`` and ``marft ui``
show the first characters of an id, and any unique prefix of at least ``MIN_PREFIX`` characters
names the episode. An exact id always wins (an id may be a prefix of a longer one)."""

from __future__ import annotations

import sqlalchemy as sa

from . import tables as t
from .records import AmbiguousEpisodeId, EpisodeNotFound

# Shorter prefixes would match half the store and name nothing useful.
MIN_PREFIX = 4
# Candidates an ambiguous prefix names in its error.
SHOWN = 5


def resolve_id(conn: sa.Connection, id_or_prefix: str) -> str:
    """The stored episode id that ``id_or_prefix`` names: the id itself when it is stored, else the one
    stored id that starts with it. EpisodeNotFound when none does (or the prefix is shorter than
    MIN_PREFIX), AmbiguousEpisodeId when several do."""
    e = t.episodes.c
    if conn.execute(sa.select(e.id).where(e.id == id_or_prefix)).first() is not None:
        return id_or_prefix
    if len(id_or_prefix) < MIN_PREFIX:
        raise EpisodeNotFound(id_or_prefix, hint=f"a prefix needs at least {MIN_PREFIX} characters")
    # LIKE with '%' and '_' in the id escaped (autoescape) finds the candidates (an index can serve it);
    # substr keeps them exact, as SQLite's LIKE ignores the case of ASCII letters.
    starts = sa.and_(e.id.startswith(id_or_prefix, autoescape=True),
                     sa.func.substr(e.id, 1, len(id_or_prefix)) == id_or_prefix)
    found = list(conn.execute(sa.select(e.id).where(starts).order_by(e.id).limit(SHOWN)).scalars())
    if len(found) == 1:
        return found[0]
    if not found:
        raise EpisodeNotFound(id_or_prefix)
    count = int(conn.execute(sa.select(sa.func.count()).select_from(t.episodes).where(starts)).scalar_one())
    raise AmbiguousEpisodeId(id_or_prefix, count, found)
