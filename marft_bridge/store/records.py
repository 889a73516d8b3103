"""Small typed results the store hands back: write reports, dead letters and what ``doctor`` found."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from ..errors import MarftError


class EpisodeNotFound(MarftError, KeyError):
    """``get_episode`` on an id the store does not hold (nor any episode whose id starts with it);
    ``hint`` says why a prefix named none."""

    def __init__(self, episode_id: str, hint: str | None = None):
        self.episode_id = episode_id
        super().__init__(f"episode {episode_id!r} is not in the store" + (f" ({hint})" if hint else ""))

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class EpisodeUnreadable(EpisodeNotFound):
    """``get_episode`` on a stored episode that cannot be read back: it was moved to the dead letters."""

    def __init__(self, episode_id: str, reason: str):
        self.episode_id, self.reason = episode_id, reason
        MarftError.__init__(self, f"episode {episode_id!r} could not be read back from the store ({reason}); "
                                  "it was moved to the dead letters (marft traces dead-letters)")


class AmbiguousEpisodeId(MarftError):
    """A prefix that begins the ids of several stored episodes (and is none of them exactly)."""

    def __init__(self, prefix: str, count: int, candidates: list[str]):
        self.prefix, self.count, self.candidates = prefix, count, candidates
        more = f", ... ({count - len(candidates)} more)" if count > len(candidates) else ""
        super().__init__(f"episode id prefix {prefix!r} is ambiguous: {count} stored episodes start with it "
                         f"({', '.join(candidates)}{more}); give more characters")


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


class Finding(BaseModel):
    """One stored episode ``doctor`` (or a read) found wrong, and why."""

    episode_id: str
    reason: str


class DoctorReport(BaseModel):
    """What ``TraceStore.doctor`` found: stored episodes that cannot be read back (moved to the dead
    letters unless ``dry_run``), and readable ones past the current record limits (kept)."""

    scanned: int = 0
    unreadable: list[Finding] = Field(default_factory=list)
    quarantined: int = 0
    over_limits: list[Finding] = Field(default_factory=list)
    dry_run: bool = False

    def __str__(self) -> str:
        moved = "listed (dry run: nothing moved)" if self.dry_run else f"{self.quarantined} moved to the dead letters"
        return (f"{self.scanned} episode(s) checked: {len(self.unreadable)} unreadable, {moved}; "
                f"{len(self.over_limits)} readable but past the record limits (kept)")
