"""``EpisodeFilter``: which stored episodes a read takes, one object shared by the store's ``episodes``,
``count``, ``episode_rows`` and ``export`` (their keyword arguments build one), and the SQL it becomes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import TypedDict

import sqlalchemy as sa

from ..errors import MarftError
from . import tables as t
from .rows import epoch

Time = datetime | float | int | str


class FilterArgs(TypedDict, total=False):
    """The keyword arguments of the store's reads: the fields of ``EpisodeFilter``."""

    source: str | None
    agent: str | None
    since: Time | None
    until: Time | None
    has_reward: bool | None
    ids: tuple[str, ...] | list[str] | None
    limit: int | None
    newest_first: bool


@dataclass(frozen=True)
class EpisodeFilter:
    """Stored episodes by start time (id breaks ties), filtered: ``source``, an ``agent`` that took part,
    started at or after ``since`` and before ``until`` (a datetime, naive taken as UTC; epoch seconds;
    ISO text), ``has_reward`` (True: at least one reward, False: none), ``ids`` (only these whole ids);
    at most ``limit``, oldest first unless ``newest_first``. ``None`` leaves a criterion out. Checked
    when built (MarftError)."""

    source: str | None = None
    agent: str | None = None
    since: Time | None = None
    until: Time | None = None
    has_reward: bool | None = None
    ids: tuple[str, ...] | None = None
    limit: int | None = None
    newest_first: bool = False

    def __post_init__(self) -> None:
        if self.ids is not None:
            if not isinstance(self.ids, (list, tuple)) or not all(isinstance(i, str) for i in self.ids):
                raise MarftError("filter ids must be a list of episode ids (text)")
            object.__setattr__(self, "ids", tuple(self.ids))  # frozen: hashable and unchangeable
        for name in ("source", "agent"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise MarftError(f"filter {name} must be text, not {type(value).__name__}")
        for name in ("since", "until"):
            epoch(getattr(self, name))  # a time that cannot be read fails here, not in the query
        if self.has_reward is not None and not isinstance(self.has_reward, bool):
            raise MarftError(f"filter has_reward must be True, False or None, not {self.has_reward!r}")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                                       or self.limit < 0):
            raise MarftError(f"filter limit must be a whole number >= 0 or None, not {self.limit!r}")
        if not isinstance(self.newest_first, bool):
            raise MarftError(f"filter newest_first must be True or False, not {self.newest_first!r}")

    @classmethod
    def of(cls, where: EpisodeFilter | None = None, **filters: object) -> EpisodeFilter:
        """``where`` with the keyword arguments laid over it (either may be absent); TypeError names a
        keyword that is not a field."""
        unknown = sorted(set(filters) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unknown episode filter(s) {', '.join(unknown)}; use: "
                            f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        if where is None:
            return cls(**filters)  # type: ignore[arg-type]
        if not isinstance(where, EpisodeFilter):
            raise TypeError(f"expected an EpisodeFilter, not {type(where).__name__}")
        return dataclasses.replace(where, **filters) if filters else where

    def clauses(self) -> list:
        """The WHERE clauses on ``marft_episodes`` (limit and order are ``select``'s)."""
        e = t.episodes.c
        where = []
        if self.source is not None:
            where.append(e.source == self.source)
        if self.agent is not None:
            agents = t.episode_agents.c
            where.append(e.id.in_(sa.select(agents.episode_id).where(agents.agent == self.agent)))
        if self.since is not None:
            where.append(e.started_at >= epoch(self.since))
        if self.until is not None:
            where.append(e.started_at < epoch(self.until))
        if self.has_reward is not None:
            where.append(e.n_rewards > 0 if self.has_reward else e.n_rewards == 0)
        if self.ids is not None:
            where.append(e.id.in_(self.ids))
        return where

    def select(self, *columns: sa.ColumnElement) -> sa.Select:
        """SELECT of episode columns: filtered, by start time (id breaks ties), at most ``limit`` rows."""
        e = t.episodes.c
        order = (e.started_at.desc(), e.id.desc()) if self.newest_first else (e.started_at, e.id)
        q = sa.select(*columns).where(*self.clauses()).order_by(*order)
        return q if self.limit is None else q.limit(self.limit)

    def count(self) -> sa.Select:
        """SELECT of how many episodes ``select`` lists (at most ``limit``)."""
        if self.limit is None:
            return sa.select(sa.func.count()).select_from(t.episodes).where(*self.clauses())
        return sa.select(sa.func.count()).select_from(self.select(t.episodes.c.id).subquery())
