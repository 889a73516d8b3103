"""TraceStore: Flex-POMDP episodes in SQLite (default) or PostgreSQL through SQLAlchemy Core.

Every episode is written whole or not at all, so a crash never leaves half an episode
(``add_episode`` is one transaction; the background writer of ``submit``, a process of its own by
default (``writer_process.py``), commits several whole, validated episodes per transaction). Writing an id
that is already stored merges: the new actions and rewards are appended (cross-process capture
writes the halves of one episode), and the merged episode must validate. Refused records go to a
dead-letter table with the reason; so does a stored episode that cannot be read back (reads skip
it, count it and move it there: ``quarantine.py``). A change log lets pollers (the continuous
fine-tuning service) see which episodes were added, merged or rewarded since they last looked.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from pydantic import ValidationError

from ..errors import MarftError, RecordError
from ..limits import RecordLimits
from ..schema import Episode, Reward, record_error
from . import tables as t
from .engines import create_engines, normalize_url, short_error
from .files import export_episodes, import_file
from .filters import EpisodeFilter
from .ids import resolve_id
from .quarantine import quarantine_tx, scan
from .reads import (READ_CHUNK, change_cursor, changes_after, dead_letter_list, load_episodes, quarantined_count,
                    store_stats, stored_size, summary_rows)
from .records import DeadLetter, DoctorReport, EpisodeNotFound, EpisodeUnreadable, Finding, Refusal, WriteReport
from .rows import MAX_DEAD_LETTER_CHARS, Rows, check_record_size, episode_rows, merge_halves, preview, to_data
from .transactions import WriteTransactions
from .writer_groups import GroupCommit, validated_rows
from .writer_process import WRITER_MODES, start_writer

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .filters import FilterArgs

log = logging.getLogger("marft_bridge.store")


class TraceStore:
    """Episodes, rewards, dead letters and a change log in one SQL database."""

    def __init__(self, url: str, *, queue_size: int = 1000, on_full: str = "block",
                 limits: RecordLimits | dict | None = None, writer: str | None = None):
        if on_full not in ("block", "drop"):
            raise MarftError(f"on_full must be 'block' or 'drop', not {on_full!r}")
        writer = writer or os.environ.get("MARFT_STORE_WRITER") or "process"
        if writer not in WRITER_MODES:
            raise MarftError(f"writer must be 'process' or 'thread', not {writer!r} (MARFT_STORE_WRITER)")
        self._writer_mode = writer
        self._sink = None  # the writer process's end, in "process" mode
        self.limits = RecordLimits.of(limits)
        self._skipped = 0  # unreadable stored episodes this object's reads passed over
        self._queue_size = queue_size
        self._on_full = on_full
        self._writer = None  # background writer for submit(), started on first use
        self._writer_lock = threading.Lock()
        self._dropped_closed = 0
        self._closed = False
        self._engine, self._reader = create_engines(url)
        # For display and logs: a password in the URL is masked.
        self.url = self._engine.url.render_as_string(hide_password=True)
        self._writes = WriteTransactions(self._engine)
        # The background writers' group commit, given what it needs of the store.
        self._groups = GroupCommit(self._writes, validate=lambda data: validated_rows(data, self.limits),
                                   to_data=lambda item: to_data(item, self.limits), add_one=self.add_episode,
                                   dead_letter=self.dead_letter, merge_tx=self._merge_tx)
        self._init_schema()

    @property
    def is_postgres(self) -> bool:
        return self._writes.is_postgres

    @property
    def secret_url(self) -> str:
        """The URL with its password, for the writer process (``url`` masks it)."""
        return self._engine.url.render_as_string(hide_password=False)

    @classmethod
    def open(cls, url: str | os.PathLike | None = None, *, queue_size: int = 1000, on_full: str = "block",
             limits: RecordLimits | dict | None = None, writer: str | None = None) -> TraceStore:
        """Open (creating if needed) a store.

        ``url``: None -> ``$MARFT_STORE`` or ``./.marft/traces.db``; a filesystem path -> SQLite file;
        ``sqlite:///...``; ``postgresql+psycopg://...`` (``postgresql://`` uses psycopg too).
        ``queue_size``/``on_full`` configure ``submit()``'s bounded queue ("block" or "drop").
        ``limits``: the record limits every write is checked against (``RecordLimits`` or a dict of
        its fields; default: ``$MARFT_MAX_*`` or the documented defaults, see ``marft_bridge.limits``).
        ``writer``: who writes submitted episodes, "process" (a writer process, the default) or
        "thread" (a thread of this process); default ``$MARFT_STORE_WRITER``.
        """
        return cls(normalize_url(url), queue_size=queue_size, on_full=on_full, limits=limits, writer=writer)

    def __repr__(self) -> str:
        return f"TraceStore({self.url!r})"

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- schema --------------------------------------------------------------------------------

    def _init_schema(self) -> None:
        try:
            with self._writes.begin() as conn:
                stored = t.create_schema(conn)
        except sa.exc.SQLAlchemyError as e:
            self._dispose()
            raise MarftError(f"cannot open trace store {self.url}: {short_error(e)}") from None
        found = int(stored) if stored is not None else t.STORE_SCHEMA_VERSION
        if found != t.STORE_SCHEMA_VERSION:
            self._dispose()
            raise MarftError(
                f"trace store {self.url} was written with store schema version {found}, but this "
                f"marft_bridge uses version {t.STORE_SCHEMA_VERSION}; open it with the matching marft_bridge "
                "version (export to JSONL there, import here) or point --store at another database"
            )

    # -- writing -------------------------------------------------------------------------------

    def add_episode(self, episode: Episode | dict | str | bytes, *, record: str | None = None) -> str:
        """Validate and write one episode in one transaction; returns its id.

        An id that is already stored is merged: new actions and rewards are appended (ones already
        stored unchanged are skipped), status/ended_at/task/group/release are updated (when the new
        half sets them) and metadata is merged.
        Bad input raises RecordError and is kept in the dead-letter table; ``record`` names the
        input in that message (for instance ``traces.jsonl line 7``).
        """
        self._check_open()
        try:
            data = to_data(episode, self.limits)
            try:
                (ep, rows), err = validated_rows(data, self.limits), None
            except RecordError as e:
                # Half of an episode may depend on actions of the stored half: judge the merge.
                ep, rows, err = None, None, e
            self._writes.retry(lambda conn: self._write_episode_tx(conn, ep, rows, data, err))
        except RecordError as e:
            if record is not None and not (e.record or "").startswith(record):
                e = RecordError(", ".join(p for p in (record, e.record) if p), e.field, e.reason)
            self.dead_letter(e, episode)
            raise e from None
        return ep.id if ep is not None else data["id"]

    def add_episodes(self, episodes: Iterable[Episode | dict | str | bytes]) -> WriteReport:
        """Write many episodes (each its own transaction); refused ones are dead-lettered and reported."""
        report = WriteReport()
        for item in episodes:
            try:
                self.add_episode(item)
                report.added += 1
            except RecordError as e:
                report.refused += 1
                report.refusals.append(Refusal(record=e.record, reason=str(e)))
        return report

    def add_reward(
        self,
        episode_id: str,
        value: float,
        agent: str | None = None,
        action_id: str | None = None,
        source: str = "user",
        **meta: Any,
    ) -> Reward:
        """Attach a (possibly late) reward to a stored episode, one agent of it, or one action of it."""
        self._check_open()
        name = f"episode {episode_id}"
        raw = {"episode_id": episode_id, "value": value, "agent": agent, "action_id": action_id, "source": source,
               "metadata": meta}
        try:
            try:
                reward = Reward.model_validate({"value": value, "agent": agent, "action_id": action_id,
                                                "source": source, "metadata": meta}, context={"limits": self.limits})
            except ValidationError as e:
                raise record_error(e, f"{name} reward") from None
            self._writes.retry(lambda conn: self._writes.insert_reward(conn, episode_id, reward))
        except RecordError as e:
            self.dead_letter(e, raw)
            raise
        return reward

    def _write_episode_tx(self, conn: sa.Connection, ep: Episode | None, rows: Rows | None, data: dict,
                          err: RecordError | None) -> None:
        if rows is not None and self._writes.insert(conn, t.episodes, rows.episode) is not None:
            self._writes.insert_children(conn, rows)
            self._writes.log_change(conn, ep.id, "add")
            return
        eid = data.get("id")
        if not (isinstance(eid, str) and self._merge_tx(conn, eid, data)):
            raise err

    def _merge_tx(self, conn: sa.Connection, eid: str, data: dict) -> bool:
        """Merge ``data`` into the stored episode ``eid``; False when it is not stored."""
        if conn.execute(self._writes.lock_episode(eid)).first() is None:
            return False
        found, bad = load_episodes(conn, [eid])
        if bad:
            raise RecordError(f"episode {eid}", None, f"the stored half cannot be read back ({bad[0].reason}), so this "
                              "half cannot be merged into it; marft traces doctor moves the stored half aside")
        old = found[0]
        merged, new_actions, new_rewards = merge_halves(old, data, self.limits)
        rows = episode_rows(merged, new_actions, new_rewards, len(old.actions), len(old.rewards))
        check_record_size(eid, stored_size(conn, eid) + rows.size, self.limits)
        rows.agents = [r for r in rows.agents if r["agent"] not in old.agents]
        conn.execute(t.episodes.update().where(t.episodes.c.id == eid).values(rows.episode))
        self._writes.insert_children(conn, rows)
        self._writes.log_change(conn, eid, "merge")
        return True

    def dead_letter(self, err: RecordError, raw: Any) -> None:
        """Keep a refused record with the reason (``dead_letters()`` lists them); ``raw`` is the record
        as text, bytes or any object, kept as ``rows.preview`` makes it (at most MAX_DEAD_LETTER_CHARS,
        never recursive: a record of any depth gets one). Never raises for a database error: the
        refusal itself is what the caller reports."""
        text = preview(raw, MAX_DEAD_LETTER_CHARS)
        try:
            with self._writes.begin() as conn:
                conn.execute(
                    t.dead_letters.insert().values(
                        record=err.record, field=err.field, reason=err.reason, raw=text, created_at=time.time()
                    )
                )
        except sa.exc.SQLAlchemyError as e:  # the refusal itself still reaches the caller
            log.error("could not keep dead letter for %s: %s", err, short_error(e))

    # -- background writes ---------------------------------------------------------------------

    def write_queued(self, items: list[Any]) -> None:
        """The background writers' group commit (``writer_groups.GroupCommit.write_queued``): queued
        episodes, several per transaction, each all-or-nothing. Errors are logged, never raised."""
        self._groups.write_queued(items)

    def submit(self, episode: Episode | dict | str | bytes) -> None:
        """Queue an episode for the background writer and return at once (capture hooks use this).

        The episode is copied now (as JSON bytes), so later changes to the object are not written.
        A writer process (``writer_process.py``; ``writer="thread"``: a thread) validates and
        writes queued episodes in groups; ``flush()`` writes everything queued at once. Errors
        there are logged and dead-lettered, never raised here. A full queue makes this wait
        (``on_full="block"``) or drops the episode (``"drop"``); waits and drops are counted in
        ``capture_stats()["store"]``, drops also in ``stats()["dropped"]``, as are episodes
        submitted to a closed store.
        """
        self._submit(episode)

    def submit_record(self, record: dict) -> None:
        """``submit`` for a capture's own record (``EpisodeRecorder.finish``): a dict key that is not
        text is stored as text (JSON's rule) instead of refusing the episode, so the record is not
        walked for keys on the app's thread (``submit`` walks a dict and refuses such keys, as
        ``add_episode`` does). The thread writer refuses them either way."""
        self._submit(record, True)

    def _submit(self, episode: Any, *copy_args: Any) -> None:
        if self._closed:
            self._dropped_closed += 1
            log.error("trace store %s is closed; episode dropped", self.url)
            return
        if self._writer is None:
            with self._writer_lock:
                if self._writer is None:
                    self._writer, self._sink = start_writer(self, self._writer_mode, self._queue_size, self._on_full)
        self._writer.submit(episode, *copy_args if self._sink is not None else ())

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted episode is written; False if ``timeout`` passed first."""
        return True if self._writer is None else self._writer.flush(timeout)

    @property
    def dropped(self) -> int:
        return self._dropped_closed + (0 if self._writer is None else self._writer.dropped)

    def writer_stats(self) -> dict[str, Any]:
        """How submitted episodes are written: ``mode`` ("process" or "thread"; ``in_thread``: the
        writer processes failed, a thread writes instead), ``queued`` (waiting) and ``pending``
        (queued or being written) episodes, the writer process's ``pid``, its ``restarts`` and the
        CPU seconds the writer processes used (``process_cpu_s``, as of their last group; not on
        this process's clock)."""
        sink, w = self._sink, self._writer
        return {"mode": self._writer_mode, "in_thread": sink is not None and sink.in_thread,
                "queued": 0 if w is None else w.queued, "pending": 0 if w is None else w.pending,
                "pid": None if sink is None else sink.pid, "restarts": 0 if sink is None else sink.restarts,
                "process_cpu_s": 0.0 if sink is None else sink.cpu_s}

    def close(self) -> None:
        """Flush submitted episodes, stop the writer (and its process), release connections. Idempotent."""
        if self._closed:
            return
        if self._writer is not None:
            self._writer.stop()
        self._closed = True
        self._dispose()

    def _dispose(self) -> None:
        self._engine.dispose()
        if self._reader is not self._engine:  # PostgreSQL uses one engine for both
            self._reader.dispose()

    def _check_open(self) -> None:
        if self._closed:
            raise MarftError(f"trace store {self.url} is closed")

    # -- reading -------------------------------------------------------------------------------

    def get_episode(self, episode_id: str, *, exact: bool = False) -> Episode:
        """The stored episode (equal to the one added, merges and rewards included).

        ``episode_id`` may be any unique prefix of a stored id, 4 characters or more (an exact id
        always wins; ``exact=True`` takes only the whole id). EpisodeNotFound (a KeyError) when it
        names none; AmbiguousEpisodeId (a MarftError) when a prefix begins several; EpisodeUnreadable
        (an EpisodeNotFound) when it is stored but cannot be read back, which moves it to the dead
        letters (see ``episodes``)."""
        self._check_open()
        with self._reader.connect() as conn:
            if not exact:
                episode_id = resolve_id(conn, episode_id)
            found, bad = load_episodes(conn, [episode_id])
        if bad:
            self._set_aside(bad)
            raise EpisodeUnreadable(episode_id, bad[0].reason)
        if not found:
            raise EpisodeNotFound(episode_id)
        return found[0]

    def resolve_id(self, id_or_prefix: str) -> str:
        """The whole id of the stored episode that ``id_or_prefix`` names (the id itself, or a unique
        prefix of 4 characters or more); EpisodeNotFound or AmbiguousEpisodeId as ``get_episode``."""
        self._check_open()
        with self._reader.connect() as conn:
            return resolve_id(conn, id_or_prefix)

    def has_episode(self, episode_id: str) -> bool:
        self._check_open()
        with self._reader.connect() as conn:
            return conn.execute(sa.select(t.episodes.c.id).where(t.episodes.c.id == episode_id)).first() is not None

    def action_ids(self, episode_id: str) -> set[str]:
        """Ids of the actions stored for an episode (empty when it is not stored), without loading it."""
        self._check_open()
        with self._reader.connect() as conn:
            rows = conn.execute(sa.select(t.actions.c.id).where(t.actions.c.episode_id == episode_id))
            return {r[0] for r in rows}

    def episodes(self, where: EpisodeFilter | None = None, /, **filters: Unpack[FilterArgs]) -> Iterator[Episode]:
        """Stored episodes by start time, filtered (``where``, an EpisodeFilter, and/or its fields as
        keywords: source, agent, since (inclusive), until (exclusive), has_reward, limit, newest_first).

        An episode that cannot be read back is skipped: logged, counted (``stats()["unreadable_skipped"]``)
        and moved to the dead letters (``stats()["quarantined"]``), so one bad row never stops a read.
        A bad filter raises here, before anything is read.
        """
        self._check_open()
        q = EpisodeFilter.of(where, **filters).select(t.episodes.c.id)
        return self._listed(q)

    def _listed(self, q: sa.Select) -> Iterator[Episode]:
        with self._reader.connect() as conn:
            ids = list(conn.execute(q).scalars())
        yield from self._read(ids)

    def get_episodes(self, episode_ids: Iterable[str]) -> list[Episode]:
        """The stored episodes of ``episode_ids``, in that order: ids not stored are left out, and so
        are episodes that cannot be read back (moved to the dead letters, as ``episodes()`` moves
        them), so one bad row never stops a caller that reads a list of ids (``get_episode`` raises
        for it). Read ``READ_CHUNK`` at a time, not one query per id."""
        self._check_open()
        return list(self._read(list(episode_ids)))

    def _read(self, ids: list[str]) -> Iterator[Episode]:
        for i in range(0, len(ids), READ_CHUNK):
            chunk = ids[i : i + READ_CHUNK]
            with self._reader.connect() as conn:
                found, bad = load_episodes(conn, chunk)
            if bad:
                self._set_aside(bad)
            yield from found

    def _set_aside(self, bad: list[Finding]) -> None:
        """Count unreadable episodes a read skipped and move them to the dead letters; a store that
        cannot be written (read-only) keeps them, logged and still skipped."""
        for f in bad:
            self._skipped += 1
            log.warning("stored episode %s cannot be read back (%s); skipped and moved to the dead letters",
                        f.episode_id, f.reason)
        self._quarantine(bad)

    def _quarantine(self, bad: list[Finding]) -> int:
        moved = 0
        for f in bad:
            try:
                moved += self._writes.retry(lambda conn: quarantine_tx(conn, self._writes, f.episode_id))
            except (MarftError, sa.exc.SQLAlchemyError) as e:
                log.error("could not move unreadable episode %s to the dead letters: %s", f.episode_id, short_error(e))
        return moved

    def doctor(self, *, dry_run: bool = False, progress: Callable[[int, int], None] | None = None) -> DoctorReport:
        """Read every stored episode: move those that cannot be read back to the dead letters (each in
        one transaction; ``dry_run`` only lists them) and list those past the current ``limits``
        (readable, kept). ``progress(done, total)`` is called as it goes."""
        self._check_open()
        return scan(self._reader, self.limits, None if dry_run else self._quarantine, progress)

    @property
    def unreadable_skipped(self) -> int:
        """Unreadable stored episodes this store object's reads skipped (each also moved to the dead letters)."""
        return self._skipped

    def quarantined(self) -> int:
        """How many unreadable stored episodes were ever moved to the dead letters (one small query)."""
        self._check_open()
        with self._reader.connect() as conn:
            return quarantined_count(conn)

    def episode_rows(self, where: EpisodeFilter | None = None, /, **filters: Unpack[FilterArgs]) -> list[dict]:
        """Summary rows (id, source, status, times, counts, agents) of the episodes ``episodes`` would
        list with the same filter, without loading them."""
        self._check_open()
        selected = EpisodeFilter.of(where, **filters)
        with self._reader.connect() as conn:
            return summary_rows(conn, selected)

    def count(self, where: EpisodeFilter | None = None, /, **filters: Unpack[FilterArgs]) -> int:
        """How many episodes ``episodes`` would list with the same filter (at most its ``limit``)."""
        self._check_open()
        q = EpisodeFilter.of(where, **filters).count()
        with self._reader.connect() as conn:
            return int(conn.execute(q).scalar_one())

    def stats(self) -> dict[str, Any]:
        """Counts: episodes, actions, rewards, dead letters (``quarantined``: unreadable stored episodes
        moved there), per agent and per source, time range."""
        self._check_open()
        with self._reader.connect() as conn:
            return store_stats(conn, self.url, self.dropped, self._skipped)

    def dead_letters(self, limit: int | None = None, raw_chars: int | None = None) -> list[DeadLetter]:
        """Refused records, newest first; ``raw_chars`` reads only the start of each raw record."""
        self._check_open()
        with self._reader.connect() as conn:
            return dead_letter_list(conn, limit, raw_chars)

    def cursor(self) -> int:
        """The current position of the change log (pass it to ``changed_since`` later)."""
        self._check_open()
        with self._reader.connect() as conn:
            return change_cursor(conn)

    def changed_since(self, cursor: int, limit: int | None = None) -> tuple[int, list[str]]:
        """Episodes added, merged or rewarded after ``cursor``: (new cursor, ids in order of change)."""
        self._check_open()
        with self._reader.connect() as conn:
            return changes_after(conn, cursor, limit)

    # -- files ---------------------------------------------------------------------------------

    def export(self, path: str | os.PathLike, format: str | None = None, where: EpisodeFilter | None = None,
               **filters: Unpack[FilterArgs]) -> int:
        """Write the episodes ``episodes`` lists with the same filter to JSONL (one episode a line) or
        Parquet; returns the count."""
        return export_episodes(self, path, format, EpisodeFilter.of(where, **filters))

    def import_(self, path: str | os.PathLike, format: str | None = None) -> WriteReport:
        """Validate and add every episode of a JSONL or Parquet file; bad records are refused and reported."""
        return import_file(self, path, format)
