"""Episodes <-> the store's rows: serializing an episode's rows, merging a second half into a
stored episode, the listing filters, and time columns as UTC epoch seconds."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from ..errors import MarftError, RecordError
from ..schema import Action, Episode, Reward, episode_data, parse_episode, record_error
from . import tables as t


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


def to_data(item: Episode | dict | str | bytes) -> dict:
    """The raw episode as a dict (JSON decoded, Episode dumped); RecordError if it is not one."""
    if isinstance(item, Episode):
        try:
            return item.model_dump()  # python mode: validating it back is twice as fast as JSON mode
        except Exception as e:  # noqa: BLE001 - a mutated object may hold anything
            raise RecordError(f"episode {item.id}", None, f"cannot serialize: {e}") from None
    return episode_data(item)


def validated(model: type, raw: Any, record: str, field: str):
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = record_error(e, record)
        raise RecordError(record, ".".join(p for p in (field, err.field) if p), err.reason) from None


def merge_halves(old: Episode, new: dict) -> tuple[Episode, list[Action], list[Reward]]:
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
            rec = validated(model, item, name, f"{key}.{k}")
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
    data["agents"] = list(dict.fromkeys(old.agents + (agents if isinstance(agents, list) else [agents])))
    for key in ("status", "ended_at", "task"):
        if new.get(key) is not None:
            data[key] = new[key]
    meta = new.get("metadata") or {}
    data["metadata"] = {**data["metadata"], **meta} if isinstance(meta, dict) else meta
    if "schema_version" in new:
        data["schema_version"] = new["schema_version"]
    return parse_episode(data), parts["actions"], parts["rewards"]


class Rows:
    """The rows one episode write inserts, serialized before the transaction starts."""

    __slots__ = ("episode", "agents", "actions", "rewards")

    def __init__(self, episode: dict, agents: list[dict], actions: list[dict], rewards: list[dict]):
        self.episode, self.agents, self.actions, self.rewards = episode, agents, actions, rewards


def episode_rows(ep: Episode, actions: list[Action] | None = None, rewards: list[Reward] | None = None,
                  action_start: int = 0, reward_start: int = 0) -> Rows:
    """Rows for ``ep`` (or, when merging, for its new ``actions``/``rewards`` from the given positions)."""
    actions = ep.actions if actions is None else actions
    rewards = ep.rewards if rewards is None else rewards
    to_json = Action.__pydantic_serializer__.to_json  # model_dump_json's keyword handling costs per call
    try:
        body = ep.model_dump_json(exclude={"actions", "rewards"})
        action_rows = [
            {"episode_id": ep.id, "seq": action_start + k, "id": a.id, "agent": a.agent, "step": a.step, "kind": a.kind,
             "body": to_json(a).decode()}
            for k, a in enumerate(actions)
        ]
        reward_rows = [reward_row(ep.id, reward_start + k, r) for k, r in enumerate(rewards)]
    except PydanticSerializationError as e:
        raise RecordError(f"episode {ep.id}", None, f"cannot be stored as JSON: {e}") from None
    episode_row = {
        "id": ep.id,
        "source": ep.source,
        "status": ep.status,
        "started_at": epoch(ep.started_at),
        "ended_at": epoch(ep.ended_at),
        "n_actions": len(ep.actions),
        "n_rewards": len(ep.rewards),
        "body": body,
    }
    return Rows(episode_row, [{"episode_id": ep.id, "agent": a} for a in ep.agents], action_rows, reward_rows)


def reward_row(episode_id: str, seq: int, r: Reward) -> dict:
    return {"episode_id": episode_id, "seq": seq, "id": r.id, "agent": r.agent, "action_id": r.action_id,
            "value": r.value, "source": r.source, "body": r.model_dump_json()}


def filter_clauses(source=None, agent=None, since=None, until=None, has_reward=None) -> list:
    e = t.episodes.c
    where = []
    if source is not None:
        where.append(e.source == source)
    if agent is not None:
        where.append(e.id.in_(sa.select(t.episode_agents.c.episode_id).where(t.episode_agents.c.agent == agent)))
    if since is not None:
        where.append(e.started_at >= epoch(since))
    if until is not None:
        where.append(e.started_at < epoch(until))
    if has_reward is not None:
        where.append(e.n_rewards > 0 if has_reward else e.n_rewards == 0)
    return where


def listing(columns: list, where: list, limit: int | None, newest_first: bool) -> sa.Select:
    """SELECT of episode columns, filtered, by start time (id breaks ties), at most ``limit`` rows."""
    e = t.episodes.c
    order = (e.started_at.desc(), e.id.desc()) if newest_first else (e.started_at, e.id)
    q = sa.select(*columns).where(*where).order_by(*order)
    return q if limit is None else q.limit(limit)


def from_epoch(x: float | None) -> datetime | None:
    return None if x is None else datetime.fromtimestamp(x, timezone.utc)


def safe_dumps(obj: Any) -> str:
    try:
        if isinstance(obj, Episode):
            return obj.model_dump_json()
        return json.dumps(obj, default=repr, ensure_ascii=False)
    except Exception:  # noqa: BLE001 - keep whatever we can of a broken record
        return repr(obj)
