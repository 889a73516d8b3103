"""Small typed results the store hands back: write reports and dead letters."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from ..errors import MarftError


class EpisodeNotFound(MarftError, KeyError):
    """``get_episode`` on an id the store does not hold."""

    def __init__(self, episode_id: str):
        self.episode_id = episode_id
        super().__init__(f"episode {episode_id!r} is not in the store")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class Refusal(BaseModel):
    record: str | None
    reason: str


class WriteReport(BaseModel):
    """What a batch write (``add_episodes``, ``import_``) did: counts and every refusal with its reason."""

    added: int = 0
    refused: int = 0
    refusals: list[Refusal] = Field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.added} added, {self.refused} refused"


class DeadLetter(BaseModel):
    """A refused record kept with the reason, so nothing sent to the store is silently lost."""

    seq: int
    record: str | None
    field: str | None
    reason: str
    raw: str | None
    created_at: datetime
