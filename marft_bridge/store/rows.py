"""Episodes <-> the store's rows: serializing an episode's rows, merging a second half into a
stored episode, time columns as UTC epoch seconds, and the bounded preview of a refused record
that its dead letter keeps (the listing filters are ``filters.EpisodeFilter``)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError

from ..errors import MarftError, RecordError
from ..limits import RecordLimits, record_within
from ..schema import Action, Episode, Reward, episode_data, parse_episode, record_error

# A dead letter keeps the refused record for inspection, but not an unbounded one.
MAX_DEAD_LETTER_CHARS = 1_000_000
# Levels a preview shows (a little past the record limit, so the cut is visible); deeper ones are "…".
PREVIEW_DEPTH = 80


def epoch(dt: datetime | float | int | str | None) -> float | None:
    """UTC epoch seconds for a time filter or column; naive datetimes are taken as UTC."""
    if dt is None:
        return None
    if isinstance(dt, (int, float)):
        return float(dt)
    if isinstance(dt, str):
        try:
            dt = datetime.fromisoformat(dt)
        except ValueError:
            raise MarftError(f"not an ISO date/time: {dt!r}") from None
    if not isinstance(dt, datetime):
        raise MarftError(f"expected a datetime, epoch seconds or ISO text, not {type(dt).__name__}")
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def to_data(item: Episode | dict | str | bytes, limits: RecordLimits | None = None) -> dict:
    """The raw episode as a dict (JSON decoded, Episode dumped); RecordError if it is not one."""
    if isinstance(item, Episode):
        try:
            return item.model_dump()  # python mode: validating it back is twice as fast as JSON mode
        except Exception as e:  # noqa: BLE001 - a mutated object may hold anything
            raise RecordError(f"episode {item.id}", None, f"cannot serialize: {e}") from None
    return episode_data(item, limits=limits)


def validated(model: type, raw: Any, record: str, field: str, limits: RecordLimits | None = None):
    try:
        return model.model_validate(raw, context={"limits": limits} if limits is not None else None)
    except ValidationError as e:
        err = record_error(e, record)
        raise RecordError(record, ".".join(p for p in (field, err.field) if p), err.reason) from None


def merge_halves(old: Episode, new: dict, limits: RecordLimits | None = None) -> tuple[Episode, list[Action], list[Reward]]:
    """Append the new half's actions and rewards to the stored episode; identical re-sent records
    are skipped (a retried write is harmless), different ones with a stored id are refused."""
    name = f"episode {old.id}"
    parts = {}
    for key, model, stored in (("actions", Action, old.actions), ("rewards", Reward, old.rewards)):
        raw = new.get(key) or []
        if not isinstance(raw, list):
            raise RecordError(name, key, f"must be a list, not {type(raw).__name__}")
        by_id = {r.id: r for r in stored}
        fresh = []
        for k, item in enumerate(raw):
            rec = validated(model, item, name, f"{key}.{k}", limits)
            if rec.id in by_id:
                # Compare only what was sent: a default like created_at=now differs on every resend.
                if any(getattr(by_id[rec.id], f) != getattr(rec, f) for f in rec.model_fields_set):
                    raise RecordError(name, f"{key}.{k}.id", f"{key[:-1]} {rec.id!r} is already stored with other content")
                continue
            fresh.append(rec)
        parts[key] = fresh
    data = old.model_dump(mode="json")
    data["actions"] += [a.model_dump(mode="json") for a in parts["actions"]]
    data["rewards"] += [r.model_dump(mode="json") for r in parts["rewards"]]
    agents = new.get("agents") or []
    agents = agents if isinstance(agents, list) else [agents]
    # Checked before use: an agent that is not text (a list, say) cannot even be deduplicated.
    for k, agent in enumerate(agents):
        if not isinstance(agent, str):
            raise RecordError(name, f"agents.{k}", f"an agent name must be text, not {type(agent).__name__}")
    data["agents"] = list(dict.fromkeys(old.agents + agents))
    for key in ("status", "ended_at", "task", "group", "release"):
        if new.get(key) is not None:
            data[key] = new[key]  # validated with the merged episode below
    meta = new.get("metadata") or {}
    if not isinstance(meta, dict):
        raise RecordError(name, "metadata", f"must be an object, not {type(meta).__name__}")
    data["metadata"] = {**data["metadata"], **meta}
    if "schema_version" in new:
        data["schema_version"] = new["schema_version"]
    return parse_episode(data, limits=limits), parts["actions"], parts["rewards"]


class Rows:
    """The rows one episode write inserts, serialized before the transaction starts; ``size`` is
    the UTF-8 length of their JSON bodies (about the episode's JSON line, when it is all of it);
    ``fields_within``: the free-form fields of every record in them are within the record limits
    (``limits.record_within``; False: not known)."""

    __slots__ = ("episode", "agents", "actions", "rewards", "size", "fields_within")

    def __init__(self, episode: dict, agents: list[dict], actions: list[dict], rewards: list[dict], size: int = 0,
                 fields_within: bool = False):
        self.episode, self.agents, self.actions, self.rewards, self.size = episode, agents, actions, rewards, size
        self.fields_within = fields_within


def check_record_size(episode_id: str, size: int, limits: RecordLimits) -> None:
    """RecordError when an episode's JSON is past ``limits.max_record_bytes``."""
    if size > limits.max_record_bytes:
        raise RecordError(f"episode {episode_id}", None, f"{size:,} bytes of JSON, over the "
                          f"{limits.max_record_bytes:,}-byte limit of one record (max_record_bytes)")


def episode_rows(ep: Episode, actions: list[Action] | None = None, rewards: list[Reward] | None = None,
                  action_start: int = 0, reward_start: int = 0, limits: RecordLimits | None = None) -> Rows:
    """Rows for ``ep`` (or, when merging, for its new ``actions``/``rewards`` from the given positions).
    With ``limits``, a whole episode past ``max_record_bytes`` is refused (RecordError), and
    ``fields_within`` says whether its bodies clear the free-form fields of the other limits."""
    whole = actions is None and rewards is None
    actions = ep.actions if actions is None else actions
    rewards = ep.rewards if rewards is None else rewards
    to_json = Action.__pydantic_serializer__.to_json  # model_dump_json's keyword handling costs per call
    judge = limits is not None and whole
    try:
        head = Episode.__pydantic_serializer__.to_json(ep, exclude={"actions", "rewards"})
        size, within = len(head), judge and record_within(ep, head, limits)
        action_rows = []
        for k, a in enumerate(actions):
            text = to_json(a)
            size += len(text) + 1
            within = within and record_within(a, text, limits)
            action_rows.append({"episode_id": ep.id, "seq": action_start + k, "id": a.id, "agent": a.agent,
                                "step": a.step, "kind": a.kind, "body": text.decode()})
        reward_rows = []
        for k, r in enumerate(rewards):
            text = Reward.__pydantic_serializer__.to_json(r)
            size += len(text) + 1
            within = within and record_within(r, text, limits)
            reward_rows.append(reward_row(ep.id, reward_start + k, r, text.decode()))
    except PydanticSerializationError as e:
        raise RecordError(f"episode {ep.id}", None, f"cannot be stored as JSON: {e}") from None
    if judge:
        check_record_size(ep.id, size, limits)
    episode_row = {
        "id": ep.id,
        "source": ep.source,
        "status": ep.status,
        "started_at": epoch(ep.started_at),
        "ended_at": epoch(ep.ended_at),
        "n_actions": len(ep.actions),
        "n_rewards": len(ep.rewards),
        "body": head.decode(),
    }
    return Rows(episode_row, [{"episode_id": ep.id, "agent": a} for a in ep.agents], action_rows, reward_rows, size,
                within)


def reward_row(episode_id: str, seq: int, r: Reward, body: str | None = None) -> dict:
    return {"episode_id": episode_id, "seq": seq, "id": r.id, "agent": r.agent, "action_id": r.action_id,
            "value": r.value, "source": r.source, "body": r.model_dump_json() if body is None else body}


def from_epoch(x: float | None) -> datetime | None:
    return None if x is None else datetime.fromtimestamp(x, timezone.utc)


# -- dead-letter previews ------------------------------------------------------------------------

_END = object()


def preview(raw: Any, max_chars: int = MAX_DEAD_LETTER_CHARS, max_depth: int = PREVIEW_DEPTH) -> str:
    """A refused record as a dead letter keeps it: text as it is, bytes decoded, anything else as
    JSON (``json.dumps``'s text for a JSON value that fits). At most ``max_chars`` characters (a cut
    is marked), containers deeper than ``max_depth`` levels as ``"…"``, objects that are not JSON
    by their type name. Iterative, so a record nested 100,000 levels deep (or one that contains
    itself) gets a preview too; it never raises."""
    try:
        if isinstance(raw, bytes):
            raw = raw[: max_chars * 4].decode("utf-8", "replace")
        if isinstance(raw, str):
            return raw if len(raw) <= max_chars else raw[:max_chars] + _cut(max_chars)
        if isinstance(raw, Episode):
            try:
                text = raw.model_dump_json()
                return text if len(text) <= max_chars else text[:max_chars] + _cut(max_chars)
            except Exception:  # noqa: BLE001 - too deep or not serializable: walk its fields instead
                pass
        return _walk(raw, max_chars, max_depth)
    except Exception as e:  # noqa: BLE001 - a preview must never take the refusal down with it
        return f"<no preview: {type(e).__name__}>"


def _cut(max_chars: int) -> str:
    return f"... [truncated: the first {max_chars:,} chars kept]"


def _walk(obj: Any, max_chars: int, max_depth: int) -> str:
    out: list[str] = []
    n = 0
    frames: list[list] = []  # [iterator, closing text, is first item, is a dict, depth of the items]
    value, depth, pending = obj, 0, True
    while n <= max_chars:
        if pending:
            pending = False
            if isinstance(value, BaseModel):  # a record (or any pydantic model): its fields
                value = {k: getattr(value, k, None) for k in type(value).model_fields}
            if isinstance(value, (dict, list, tuple)):
                is_dict = isinstance(value, dict)
                if not value:
                    text = "{}" if is_dict else "[]"
                elif depth >= max_depth:
                    text = '"…"'
                else:
                    frames.append([iter(value.items() if is_dict else value), "}" if is_dict else "]", True, is_dict,
                                   depth + 1])
                    text = "{" if is_dict else "["
            else:
                text = _leaf(value, max_chars - n)
            out.append(text)
            n += len(text)
            continue
        if not frames:
            return "".join(out)
        frame = frames[-1]
        item = next(frame[0], _END)
        if item is _END:
            frames.pop()
            out.append(frame[1])
            n += 1
            continue
        sep = "" if frame[2] else ", "
        frame[2] = False
        if frame[3]:
            key, value = item
            sep += json.dumps(key if isinstance(key, str) else str(key), ensure_ascii=False) + ": "
        else:
            value = item
        out.append(sep)
        n += len(sep)
        depth, pending = frame[4], True
    return "".join(out)[:max_chars] + _cut(max_chars)


def _leaf(v: Any, room: int) -> str:
    if isinstance(v, str):
        return json.dumps(v[: max(room, 0) + 1], ensure_ascii=False)
    if v is None or isinstance(v, (bool, int, float)):
        try:
            return json.dumps(v)
        except ValueError:  # an int too long to print
            return '"<int>"'
    if isinstance(v, bytes):
        return json.dumps(v[: max(room, 0) + 1].decode("utf-8", "replace"), ensure_ascii=False)
    if isinstance(v, datetime):
        return json.dumps(v.isoformat())
    return json.dumps(f"<{type(v).__name__}>")

