"""The store's relational layout (SQLAlchemy Core), shared by SQLite and PostgreSQL, and ``create_schema``.

Episodes, actions and rewards are normalized so late rewards and merged halves of an episode are
plain inserts. Each row keeps its record as JSON text (``body``) for a lossless round trip — both
backends then run one code path — next to the few columns that queries filter on.
"""

from __future__ import annotations

import sqlalchemy as sa

# Bump when the layout below changes; a database written with another version is refused.
STORE_SCHEMA_VERSION = 1

metadata = sa.MetaData()

meta = sa.Table(
    "marft_meta",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

episodes = sa.Table(
    "marft_episodes",
    metadata,
    sa.Column("id", sa.String(256), primary_key=True),
    sa.Column("source", sa.String(256), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    # UTC epoch seconds: comparable across time zones (the ISO text with its offset lives in body).
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("ended_at", sa.Float),
    sa.Column("n_actions", sa.Integer, nullable=False),
    sa.Column("n_rewards", sa.Integer, nullable=False),
    sa.Column("body", sa.Text, nullable=False),  # the episode without actions and rewards
    sa.Index("ix_marft_episodes_started_at", "started_at"),
    sa.Index("ix_marft_episodes_source", "source"),
)

episode_agents = sa.Table(
    "marft_episode_agents",
    metadata,
    sa.Column("episode_id", sa.String(256), primary_key=True),
    sa.Column("agent", sa.String(256), primary_key=True),
    sa.Index("ix_marft_episode_agents_agent", "agent"),
    sqlite_with_rowid=False,  # small rows: one b-tree instead of table + key index (fewer pages per commit)
)

actions = sa.Table(
    "marft_actions",
    metadata,
    sa.Column("episode_id", sa.String(256), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),  # recording order within the episode
    sa.Column("id", sa.String(256), nullable=False),
    sa.Column("agent", sa.String(256), nullable=False),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    # No agent index here: agent filters go through marft_episode_agents; each index costs pages per commit.
)

rewards = sa.Table(
    "marft_rewards",
    metadata,
    sa.Column("episode_id", sa.String(256), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("id", sa.String(256), nullable=False),
    sa.Column("agent", sa.String(256)),
    sa.Column("action_id", sa.String(256)),
    sa.Column("value", sa.Float, nullable=False),
    sa.Column("source", sa.String(256), nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    sqlite_with_rowid=False,
)

dead_letters = sa.Table(
    "marft_dead_letters",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("record", sa.Text),
    sa.Column("field", sa.Text),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("raw", sa.Text),
    sa.Column("created_at", sa.Float, nullable=False),
)

# Monotone change log: one row per episode write or reward; pollers keep the last seq they saw.
changes = sa.Table(
    "marft_changes",
    metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("episode_id", sa.String(256), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)


def create_schema(conn: sa.Connection) -> str | None:
    """Create the missing tables in ``conn``'s transaction; returns the store schema version the
    database was written with as stored (None for a fresh one, which is stamped with ours)."""
    if conn.dialect.name == "postgresql":
        # Serialize concurrent first opens of one fresh database.
        conn.execute(sa.text("select pg_advisory_xact_lock(hashtext(current_schema() || '.marft_meta'))"))
    metadata.create_all(conn, checkfirst=True)
    row = conn.execute(sa.select(meta.c.value).where(meta.c.key == "store_schema_version")).first()
    if row is None:
        conn.execute(meta.insert().values(key="store_schema_version", value=str(STORE_SCHEMA_VERSION)))
        return None
    return row.value
