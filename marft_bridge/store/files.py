"""Export and import of episodes: JSONL (one episode a line) and Parquet (one row an action).

Both are lossless: JSONL holds each episode's JSON as is; Parquet has flat columns for analysis
with pandas or ``datasets`` (agent, step, kind, text, token ids, log-probs, the offered tools and
the tool calls made as JSON, ...) plus the exact
JSON of each action (``action_json``) and of the episode around it (``episode_json``,
``rewards_json``), which is what import reads. An episode without actions is one row with empty
action columns.

Import holds one record at a time, bounded by the store's ``limits.max_record_bytes``: a JSONL
line is read up to that many bytes, and a longer one is refused (its first bytes kept as the dead
letter) and skipped to its end in small reads; a Parquet episode is assembled from small batches
of rows and refused once its JSON passes the limit. Every record that fails, for any reason, is
refused and dead-lettered alone; the rest of the file goes on.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import MarftError, RecordError
from ..limits import default_limits
from ..schema import parse_episode
from .records import Refusal, WriteReport

if TYPE_CHECKING:
    from ..limits import RecordLimits
    from ..schema import Episode
    from .filters import EpisodeFilter


class EpisodeStore(Protocol):
    """What export and import need of a store (``TraceStore``'s public methods)."""

    limits: RecordLimits

    def episodes(self, where: EpisodeFilter | None = None, /) -> Iterator[Episode]: ...

    def add_episode(self, episode: Any, *, record: str | None = None) -> str: ...

    def dead_letter(self, error: RecordError, raw: Any) -> None: ...

FORMATS = ("jsonl", "parquet")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
_BATCH = 500  # episodes per Parquet row group while exporting
_READ_ROWS = 64  # Parquet rows per batch while importing (an action's row may hold a long text)
_SKIP_CHUNK = 1 << 20  # bytes per read while skipping the rest of an over-long line
_KEPT = 64 * 1024  # bytes of a refused over-long record its dead letter keeps


def detect_format(path: str | os.PathLike, format: str | None) -> str:
    if format is not None:
        if format not in FORMATS:
            raise MarftError(f"unknown format {format!r}; use one of: {', '.join(FORMATS)}")
        return format
    if str(path) == "-":
        return "jsonl"
    fmt = _SUFFIXES.get(Path(path).suffix.lower())
    if fmt is None:
        raise MarftError(f"cannot tell the format of {str(path)!r} from its suffix; pass format= (jsonl or parquet)")
    return fmt


# -- export ------------------------------------------------------------------------------------


def export_episodes(store: EpisodeStore, path: str | os.PathLike, format: str | None = None,
                    where: EpisodeFilter | None = None) -> int:
    fmt = detect_format(path, format)
    episodes = store.episodes(where)
    if fmt == "parquet":
        return _export_parquet(episodes, Path(path))
    if str(path) == "-":
        return _write_jsonl(episodes, sys.stdout)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so a failed export never leaves a truncated file behind.
    tmp = Path(f"{path}.partial")
    with open(tmp, "w", encoding="utf-8") as f:
        n = _write_jsonl(episodes, f)
    os.replace(tmp, path)
    return n


def _write_jsonl(episodes: Iterator[Episode], f) -> int:
    n = 0
    for ep in episodes:
        f.write(ep.model_dump_json())
        f.write("\n")
        n += 1
    return n


def _pyarrow():
    """(pyarrow, pyarrow.parquet), or one clear error when the optional dependency is missing."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise MarftError("Parquet needs pyarrow: pip install 'marft-bridge[parquet]'") from None
    return pa, pq


def _parquet_schema():
    import pyarrow as pa

    ts = pa.timestamp("us", tz="UTC")
    return pa.schema(
        [
            ("episode_id", pa.string()),
            ("source", pa.string()),
            ("status", pa.string()),
            ("started_at", ts),
            ("ended_at", ts),
            ("agents", pa.list_(pa.string())),
            ("team_reward", pa.float64()),
            ("n_rewards", pa.int32()),
            ("action_index", pa.int32()),
            ("action_id", pa.string()),
            ("agent", pa.string()),
            ("step", pa.int32()),
            ("kind", pa.string()),
            ("depends_on", pa.list_(pa.string())),
            ("policy_name", pa.string()),
            ("policy_version", pa.int64()),
            ("text", pa.string()),
            ("token_ids", pa.list_(pa.int64())),
            ("logprobs", pa.list_(pa.float64())),
            ("prompt_token_ids", pa.list_(pa.int64())),
            ("messages_json", pa.string()),
            ("tools_json", pa.string()),  # the tools the model was offered (null: none)
            ("tool_calls_json", pa.string()),  # the tool calls it made (null: none)
            ("action_json", pa.string()),
            ("episode_json", pa.string()),
            ("rewards_json", pa.string()),
        ]
    )


def _utc(dt: datetime | None) -> datetime | None:
    if dt is None:
        return None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)


def _rows(ep: Episode) -> Iterator[dict]:
    head = ep.model_dump(mode="json", exclude={"actions", "rewards"})
    common = {
        "episode_id": ep.id,
        "source": ep.source,
        "status": ep.status,
        "started_at": _utc(ep.started_at),
        "ended_at": _utc(ep.ended_at),
        "agents": ep.agents,
        "team_reward": ep.team_reward(),
        "n_rewards": len(ep.rewards),
        "episode_json": json.dumps(head, ensure_ascii=False),
        "rewards_json": json.dumps([r.model_dump(mode="json") for r in ep.rewards], ensure_ascii=False),
    }
    if not ep.actions:
        yield common
    for k, a in enumerate(ep.actions):
        yield {
            **common,
            "action_index": k,
            "action_id": a.id,
            "agent": a.agent,
            "step": a.step,
            "kind": a.kind,
            "depends_on": a.depends_on,
            "policy_name": a.policy.name if a.policy else None,
            "policy_version": a.policy.version if a.policy else None,
            "text": a.output.text,
            "token_ids": a.output.token_ids,
            "logprobs": a.output.logprobs,
            "prompt_token_ids": a.observation.prompt_token_ids,
            "messages_json": json.dumps([m.model_dump(mode="json") for m in a.observation.messages], ensure_ascii=False),
            "tools_json": None if a.observation.tools is None else json.dumps(a.observation.tools, ensure_ascii=False),
            "tool_calls_json": None if a.output.tool_calls is None else json.dumps(a.output.tool_calls,
                                                                                   ensure_ascii=False),
            "action_json": a.model_dump_json(),
        }


def _export_parquet(episodes: Iterator[Episode], path: Path) -> int:
    pa, pq = _pyarrow()
    schema = _parquet_schema()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.partial")
    n = 0
    batch: list[dict] = []
    with pq.ParquetWriter(tmp, schema) as writer:
        for ep in episodes:
            batch.extend(_rows(ep))
            n += 1
            if n % _BATCH == 0:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                batch = []
        if batch or n == 0:
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))
    os.replace(tmp, path)
    return n


# -- import ------------------------------------------------------------------------------------


def import_file(store: EpisodeStore, path: str | os.PathLike, format: str | None = None) -> WriteReport:
    fmt = detect_format(path, format)
    if str(path) != "-" and not Path(path).is_file():
        raise MarftError(f"no such file: {path}")
    cap = store.limits.max_record_bytes
    records = _read_parquet(Path(path), cap) if fmt == "parquet" else read_jsonl(path, cap)
    report = WriteReport()
    for name, raw in records:
        try:
            if isinstance(raw, RefusedRecord):
                store.dead_letter(raw.error, raw.raw)
                raise raw.error
            _import_one(store, name, raw)
            report.added += 1
        except RecordError as e:
            report.refused += 1
            report.refusals.append(Refusal(record=e.record, reason=str(e)))
    return report


def _import_one(store: EpisodeStore, name: str, raw: Any) -> None:
    try:
        store.add_episode(raw, record=name)  # a refused record is dead-lettered there
    except MarftError:  # RecordError; or the store itself failed (closed, database gone): not this record's doing
        raise
    except Exception as e:  # noqa: BLE001 - anything else refuses this record alone
        err = RecordError(name, None, f"cannot be imported: {type(e).__name__}: {e}")
        store.dead_letter(err, raw)
        raise err from None


def read_jsonl(path: str | os.PathLike, cap: int, label: str | None = None
               ) -> Iterator[tuple[str, str | bytes | RefusedRecord]]:
    """(``<label> line <n>``, line) of each non-blank line (``-``: stdin), as text (bytes when not
    UTF-8: refused as malformed JSON, kept raw); a line longer than ``cap`` bytes is never held
    whole: a RefusedRecord with its first bytes, and skipped to its end. ``label``: the file's name."""
    label = label or ("stdin" if str(path) == "-" else Path(path).name)
    f = sys.stdin.buffer if str(path) == "-" else open(path, "rb")
    try:
        n = 0
        while line := f.readline(cap + 1):
            n += 1
            name = f"{label} line {n}"
            if len(line) > cap and not line.endswith(b"\n"):  # at most cap + 1 bytes were read
                kept, size = line[:_KEPT], len(line)
                del line
                while rest := f.readline(_SKIP_CHUNK):
                    size += len(rest)
                    if rest.endswith(b"\n"):
                        break
                why = (f"a line of {size:,}+ bytes, over the {cap:,}-byte limit of one record (max_record_bytes); "
                       "skipped unread")
                yield name, RefusedRecord(RecordError(name, None, why),
                                          kept.decode("utf-8", "replace") + f"... [{size:,}+ bytes in all]")
                continue
            if line.strip():
                try:
                    yield name, line.decode("utf-8")
                except UnicodeDecodeError:
                    yield name, line
    finally:
        if f is not sys.stdin.buffer:
            f.close()


# The columns import reads, and what each may hold: text, a whole number, or null where marked.
_READ_COLUMNS = {"episode_id": (str, False), "action_index": (int, True), "action_json": (str, True),
                 "episode_json": (str, False), "rewards_json": (str, False)}


def _wrong_type(r: dict) -> tuple[str, str] | None:
    """(column, why) of the first column of a Parquet row that does not hold what import reads, or None.
    A whole float in action_index is taken as its int: pandas writes an int column with nulls as floats."""
    if isinstance(r["action_index"], float) and r["action_index"].is_integer():
        r["action_index"] = int(r["action_index"])
    for col, (kind, nullable) in _READ_COLUMNS.items():
        v = r[col]
        what = ("text" if kind is str else "a whole number") + (" or null" if nullable else "")
        if v is None and not nullable:
            return col, f"is null, not {what}"
        if v is not None and (isinstance(v, bool) or not isinstance(v, kind)):
            return col, f"holds {type(v).__name__}, not {what}"
    if (r["action_index"] is None) != (r["action_json"] is None):
        return "action_index/action_json", "sets one of them: both are set (an action) or both null (no actions)"
    return None


def _read_parquet(path: Path, cap: int) -> Iterator[tuple[str, dict | RefusedRecord]]:
    """Episodes rebuilt from the JSON columns, in file order (rows of one episode are contiguous).
    Every column read is type-checked first (``_wrong_type``): an episode with a row that holds a
    wrong type is refused, naming the row and the column; so is one whose JSON passes ``cap`` bytes.
    A refused episode keeps its first row as the dead letter; its other rows are counted, not kept."""
    _, pq = _pyarrow()
    needed = list(_READ_COLUMNS)
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise MarftError(f"{path.name} is not a readable Parquet file: {e}") from None
    missing = [c for c in needed if c not in pf.schema_arrow.names]
    if missing:
        raise MarftError(f"{path.name} lacks the column(s) {', '.join(missing)}; was it written by marft traces export?")
    current: Any = None
    rows: list[dict] = []
    first_row = row_no = size = 0
    refused: RecordError | None = None  # why the current episode is refused: its remaining rows are not kept

    def done() -> tuple[str, dict | RefusedRecord]:
        if refused is None:
            return _episode_from_rows(path.name, first_row, rows)
        name = f"{path.name} rows {first_row}-{row_no - 1}"
        raw = json.dumps(rows[:1], default=str, ensure_ascii=False)[:_KEPT]
        return name, RefusedRecord(RecordError(name, refused.field, refused.reason), raw)

    for batch in pf.iter_batches(columns=needed, batch_size=_READ_ROWS):
        for r in batch.to_pylist():
            if r["episode_id"] != current and (rows or refused):
                yield done()
                rows, size, refused = [], 0, None
            if not rows and refused is None:
                current, first_row = r["episode_id"], row_no
            row_no += 1
            if refused is not None:
                continue
            rows.append(r)
            if wrong := _wrong_type(r):
                refused, rows = RecordError(None, wrong[0], f"row {row_no - 1} {wrong[1]}"), rows[-1:]
                continue
            head = len(r["episode_json"]) + len(r["rewards_json"]) if len(rows) == 1 else 0  # once an episode
            size += len(r["action_json"] or "") + head
            if size > cap:
                refused = RecordError(None, None, f"episode {current}: {size:,}+ bytes of JSON, over the {cap:,}-byte "
                                      "limit of one record (max_record_bytes)")
                rows = rows[:1]
    if rows or refused:
        yield done()


def _episode_from_rows(label: str, first_row: int, rows: list[dict]) -> tuple[str, dict | RefusedRecord]:
    name = f"{label} rows {first_row}-{first_row + len(rows) - 1}"
    try:
        episode = json.loads(rows[0]["episode_json"])
        episode["rewards"] = json.loads(rows[0]["rewards_json"])
        acts = sorted((r for r in rows if r["action_json"] is not None), key=lambda r: r["action_index"])
        episode["actions"] = [json.loads(r["action_json"]) for r in acts]
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as e:
        why = "JSON nested too deep to read (far past the max_depth limit)" if isinstance(e, RecursionError) else e
        raw = json.dumps(rows, default=str, ensure_ascii=False)
        return name, RefusedRecord(RecordError(name, "action_json/episode_json", f"not episode JSON: {why}"), raw)
    return name, episode


def read_jsonl_episodes(path: str | os.PathLike, limits: RecordLimits | None = None,
                        label: str | None = None) -> Iterator[Episode | RecordError]:
    """Each non-blank line of a JSONL file validated as an Episode, or the RecordError that refuses
    it (``read_jsonl``: a line is never read past ``limits.max_record_bytes``; default limits:
    ``limits.default_limits()``). OSError when the file cannot be opened or read."""
    limits = limits or default_limits()
    for name, raw in read_jsonl(path, limits.max_record_bytes, label):
        try:
            yield raw.error if isinstance(raw, RefusedRecord) else parse_episode(raw, name, limits)
        except RecordError as e:
            yield e


class RefusedRecord:
    """A record that could not even be assembled: refused as is, with the reason."""

    def __init__(self, error: RecordError, raw: str):
        self.error, self.raw = error, raw
