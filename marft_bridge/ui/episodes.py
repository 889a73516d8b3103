"""What the viewer knows about stored episodes: a summary index for the list, and per-episode views.

The store filters by source, agent, time and reward presence, but the list also filters by reward
value, adapter version, status, errors and task text, and counts per agent and version. So the
viewer keeps one small summary per episode in memory, built once from the store and kept current
through the store's change log (``changed_since``), which is also what makes new episodes appear
in the browser without a reload. Whole episodes are loaded only when one is opened (a few are
cached, so clicking through a 10k-action episode does not reload it). A stored episode that cannot
be read back is skipped by the store (and moved to its dead letters); the list says how many.

Actions are named by their index in the episode (``#k``) beside their ids: captured ids are
time-ordered, so ids made in the same minute share their first digits.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any

from ..errors import MarftError
from ..schema import Action, Episode

log = logging.getLogger("marft_bridge.ui")

TASK_TEXT_CHARS = 400  # how much task text the list shows and searches
MAX_PAGE = 200  # episodes per list page
MAX_ACTION_PAGE = 500  # actions per page of an episode's action list
# Above this many actions an episode's graph is drawn one node per (step, agent) group.
COLLAPSE_ABOVE = 300
REFRESH_EVERY_S = 0.5
CACHED_EPISODES = 4


def episode_reward(ep: Episode) -> float | None:
    """The team reward; for an episode rewarded only per agent or action, the sum of its rewards."""
    team = ep.team_reward()
    if team is not None or not ep.rewards:
        return team
    return sum(r.value for r in ep.rewards)


def version_label(name: str, version: int | None) -> str:
    return f"{name}:v{version}" if version is not None else f"{name}:?"


def _iso(dt: datetime | None) -> str | None:
    return dt.astimezone(timezone.utc).isoformat() if dt else None


def _task_text(task: Any) -> str:
    text = task if isinstance(task, str) else json.dumps(task, default=str, ensure_ascii=False)
    return (text or "")[:TASK_TEXT_CHARS]


def summarize(ep: Episode) -> dict[str, Any]:
    """One row of the episode list (small: the index holds one per stored episode)."""
    kinds: dict[str, int] = {}
    versions: set[str] = set()
    errors = 0
    for a in ep.actions:
        kinds[a.kind] = kinds.get(a.kind, 0) + 1
        if a.policy is not None:
            versions.add(version_label(a.policy.name, a.policy.version))
        errors += a.error is not None
    capture_errors = ep.metadata.get("capture_errors")
    return {
        "id": ep.id, "source": ep.source, "status": ep.status,
        "started_at": _iso(ep.started_at), "ended_at": _iso(ep.ended_at), "t": ep.started_at.timestamp(),
        "agents": list(ep.agents), "n_actions": len(ep.actions), "kinds": kinds,
        "n_rewards": len(ep.rewards), "reward": episode_reward(ep), "versions": sorted(versions),
        "action_errors": errors, "capture_errors": capture_errors if isinstance(capture_errors, int) else 0,
        "task": _task_text(ep.task),
    }


def _float(value: str | None, name: str) -> float | None:
    if value in (None, ""):
        return None
    try:
        x = float(value)
    except ValueError:
        raise MarftError(f"{name}: not a number: {value!r}") from None
    if x != x:  # NaN compares false with everything: it would filter nothing, silently
        raise MarftError(f"{name}: not a number: {value!r}")
    return x


AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _time(value: str | None, name: str) -> float | None:
    """An ISO date/time (UTC when it has no zone) or an age like 30m, 6h, 7d, as epoch seconds."""
    if value in (None, ""):
        return None
    if value[:-1].isdecimal() and value[-1:] in AGE_UNITS:  # isdecimal: what int() reads ("²" is a digit)
        try:
            return time.time() - int(value[:-1]) * AGE_UNITS[value[-1]]
        except (OverflowError, ValueError):  # past a float, or more digits than int() reads
            raise MarftError(f"{name}: age too large: {value[:40]!r}{'...' if len(value) > 40 else ''}") from None
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise MarftError(f"{name}: not an ISO date/time or an age like 7d: {value!r}") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


class EpisodeIndex:
    """Summaries of every stored episode, current to the store's change log."""

    def __init__(self, store):
        self.store = store
        self._lock = threading.Lock()
        self._rows: dict[str, dict] = {}
        self._cache: OrderedDict[str, Episode] = OrderedDict()
        self._checked = 0.0
        # The cursor is taken before the scan: whatever changes during it is applied again after.
        self.cursor = store.cursor()
        self.total = store.count()
        self.scan_error: str | None = None
        # A big store takes a while to read, so the scan runs beside the server (newest first: the
        # first page fills soonest) and the list says how far it got.
        self.ready = threading.Event()
        threading.Thread(target=self._scan, name="marft-ui-index", daemon=True).start()

    def _scan(self) -> None:
        try:
            for ep in self.store.episodes(newest_first=True):
                row = summarize(ep)
                with self._lock:
                    # A row the change log already refreshed is newer than this read: keep it.
                    self._rows.setdefault(ep.id, row)
        except Exception as e:  # noqa: BLE001 - a store gone away (closed at exit) ends the scan; say why
            self.scan_error = f"{type(e).__name__}: {e}"
            log.warning("marft ui: reading the store stopped: %s", self.scan_error)
        finally:
            self.ready.set()

    def progress(self) -> dict | None:
        """None once every stored episode is indexed, else how far the scan got."""
        if self.ready.is_set() and self.scan_error is None:
            return None
        with self._lock:
            return {"indexed": len(self._rows), "total": max(self.total, len(self._rows)), "error": self.scan_error}

    # -- keeping current -------------------------------------------------------------------------

    def refresh(self) -> None:
        """Apply the change log since the last look (at most every REFRESH_EVERY_S)."""
        with self._lock:
            if time.monotonic() - self._checked < REFRESH_EVERY_S:
                return
            self._checked = time.monotonic()
            while True:
                cursor, ids = self.store.changed_since(self.cursor, limit=1000)
                if not ids:
                    break
                for eid in ids:
                    self._cache.pop(eid, None)
                    try:
                        self._rows[eid] = summarize(self.store.get_episode(eid, exact=True))
                    except KeyError:  # the store's EpisodeNotFound: not stored (any more)
                        self._rows.pop(eid, None)
                self.cursor = cursor

    def changes(self, cursor: int) -> dict:
        """Summaries of the episodes changed after ``cursor`` (a value an earlier answer gave)."""
        if cursor < 0:  # no answer gives one; a huge negative one overflows the store's query
            raise MarftError("cursor must be >= 0")
        self.refresh()
        with self._lock:
            if cursor >= self.cursor:
                return {"cursor": self.cursor, "episodes": []}
        _, ids = self.store.changed_since(cursor, limit=MAX_PAGE)
        with self._lock:
            rows = [self._rows[i] for i in ids if i in self._rows]
        rows.sort(key=lambda r: r["t"], reverse=True)
        return {"cursor": self.cursor, "episodes": rows}

    def episode(self, episode_id: str) -> Episode:
        """The whole episode, by its id or any unique prefix of it (raises the store's EpisodeNotFound,
        a KeyError, or AmbiguousEpisodeId, a MarftError: a 400 naming some candidates)."""
        with self._lock:
            if episode_id in self._cache:
                self._cache.move_to_end(episode_id)
                return self._cache[episode_id]
        ep = self.store.get_episode(episode_id)
        with self._lock:
            self._cache[ep.id] = ep  # by the whole id: a prefix may name another episode later
            while len(self._cache) > CACHED_EPISODES:
                self._cache.popitem(last=False)
        return ep

    # -- the list --------------------------------------------------------------------------------

    def query(self, params: dict[str, str]) -> dict:
        """A page of summaries (newest first) matching the filters, with counts over all matches."""
        self.refresh()
        offset = int(params.get("offset") or 0)
        limit = int(params.get("limit") or 50)
        if offset < 0 or not 1 <= limit <= MAX_PAGE:
            raise MarftError(f"limit must be 1..{MAX_PAGE} and offset >= 0")
        source, agent, status = params.get("source"), params.get("agent"), params.get("status")
        version = params.get("version")
        has_reward = {"": None, None: None, "true": True, "false": False}.get(params.get("has_reward"), "bad")
        if has_reward == "bad":
            raise MarftError("has_reward: use true or false")
        lo, hi = _float(params.get("reward_min"), "reward_min"), _float(params.get("reward_max"), "reward_max")
        since, until = _time(params.get("since"), "since"), _time(params.get("until"), "until")
        errors = params.get("errors") == "true"
        q = (params.get("q") or "").strip().lower()

        def keep(r: dict) -> bool:
            return not (
                (source and r["source"] != source) or (agent and agent not in r["agents"])
                or (status and r["status"] != status) or (version and version not in r["versions"])
                or (has_reward is not None and (r["n_rewards"] > 0) != has_reward)
                or (lo is not None and (r["reward"] is None or r["reward"] < lo))
                or (hi is not None and (r["reward"] is None or r["reward"] > hi))
                or (since is not None and r["t"] < since) or (until is not None and r["t"] >= until)
                or (errors and not (r["action_errors"] or r["capture_errors"]))
                or (q and q not in r["id"].lower() and q not in r["task"].lower())
            )

        with self._lock:
            rows = [r for r in self._rows.values() if keep(r)]
            everything = list(self._rows.values())
        rows.sort(key=lambda r: r["t"], reverse=True)
        counts: dict[str, dict[str, int]] = {"agents": {}, "versions": {}, "sources": {}, "statuses": {}}
        for r in rows:
            for a in r["agents"]:
                counts["agents"][a] = counts["agents"].get(a, 0) + 1
            for v in r["versions"]:
                counts["versions"][v] = counts["versions"].get(v, 0) + 1
            counts["sources"][r["source"]] = counts["sources"].get(r["source"], 0) + 1
            counts["statuses"][r["status"]] = counts["statuses"].get(r["status"], 0) + 1
        choices = {  # what the filter menus offer: every value in the store, not just the matches
            "sources": sorted({r["source"] for r in everything}),
            "agents": sorted({a for r in everything for a in r["agents"]}),
            "versions": sorted({v for r in everything for v in r["versions"]}),
        }
        return {"total": len(rows), "offset": offset, "limit": limit, "cursor": self.cursor, "indexing": self.progress(),
                "items": rows[offset:offset + limit], "counts": counts, "choices": choices,
                "stored": len(everything), "unreadable": self.unreadable()}

    def unreadable(self) -> dict[str, int]:
        """Stored episodes that could not be read back: ``quarantined`` (moved to the dead letters,
        ever) and ``skipped`` (by this viewer's reads, moved or, on a read-only store, not)."""
        return {"quarantined": self.store.quarantined(), "skipped": self.store.unreadable_skipped}

    def served(self) -> dict[str, dict]:
        """Per adapter version label: how many captured episodes it served and their mean reward."""
        self.refresh()
        out: dict[str, dict] = {}
        with self._lock:
            rows = list(self._rows.values())
        for r in rows:
            for v in r["versions"]:
                s = out.setdefault(v, {"episodes": 0, "rewarded": 0, "reward_sum": 0.0})
                s["episodes"] += 1
                if r["reward"] is not None:
                    s["rewarded"] += 1
                    s["reward_sum"] += r["reward"]
        return {v: {"episodes": s["episodes"], "rewarded": s["rewarded"],
                    "mean_reward": s["reward_sum"] / s["rewarded"] if s["rewarded"] else None}
                for v, s in out.items()}


# -- one episode ----------------------------------------------------------------------------------


def action_indexes(ep: Episode) -> dict[str, int]:
    """Each action id's index in the episode: the ``#k`` the viewer names actions by."""
    return {a.id: k for k, a in enumerate(ep.actions)}


def credited(ep: Episode) -> list[dict]:
    """Per reward, the actions it credits: the rewarded action (action reward), the agent's last
    action (agent reward) or the episode's final decisions (team reward: the last step's actions
    nothing depends on, its model calls and messages when it has any, not a tool's or env's side
    step), with everything they depend on in D, transitively."""
    by_id = {a.id: a for a in ep.actions}
    needed = {d for a in ep.actions for d in a.depends_on}
    last_step = max((a.step for a in ep.actions), default=0)
    sinks = [a for a in ep.actions if a.step == last_step and a.id not in needed]
    finals = [a.id for a in sinks if a.kind in ("llm", "message")] or [a.id for a in sinks]
    pos = action_indexes(ep)
    out = []
    for r in ep.rewards:
        if r.action_id is not None:
            roots = [r.action_id]
        elif r.agent is not None:
            own = [a.id for a in ep.actions if a.agent == r.agent]
            roots = own[-1:]
        else:
            roots = finals
        seen: set[str] = set()
        stack = list(roots)
        while stack:
            aid = stack.pop()
            if aid not in seen:
                seen.add(aid)
                stack.extend(by_id[aid].depends_on)
        out.append({"reward_id": r.id, "value": r.value, "agent": r.agent, "action_id": r.action_id,
                    "action_index": pos.get(r.action_id), "source": r.source, "created_at": _iso(r.created_at),
                    "actions": [a.id for a in ep.actions if a.id in seen]})
    return out


def _label(a: Action) -> str:
    if a.kind == "tool":
        for m in a.observation.messages:
            for c in m.tool_calls or ():
                name = (c.get("function") or {}).get("name") or c.get("name")
                if name:
                    return str(name)
        return str(a.metadata.get("tool") or a.metadata.get("mcp.tool") or "tool")
    if a.output.tool_calls:
        names = [(c.get("function") or {}).get("name") or c.get("name") or "?" for c in a.output.tool_calls]
        return "calls " + ", ".join(map(str, names))
    return (a.output.text or a.error or "").strip().replace("\n", " ")[:40]


def action_row(k: int, a: Action, pos: dict[str, int]) -> dict:
    """One action of a list or graph; ``pos`` maps the episode's action ids to their indexes."""
    return {"index": k, "id": a.id, "agent": a.agent, "step": a.step, "kind": a.kind, "label": _label(a),
            "depends_on": list(a.depends_on), "depends_on_index": [pos[d] for d in a.depends_on],
            "error": a.error is not None,
            "policy": version_label(a.policy.name, a.policy.version) if a.policy else None}


def graph(ep: Episode) -> dict:
    """D laid out for drawing: agents as lanes, steps as columns, one node per action and one edge
    per ``depends_on`` entry; above COLLAPSE_ABOVE actions, one node per (step, agent) group and one
    edge per pair of groups (with the number of dependencies it stands for)."""
    steps = ep.steps()
    col = {s: i for i, s in enumerate(steps)}
    lane = {a: i for i, a in enumerate(ep.agents)}
    collapsed = len(ep.actions) > COLLAPSE_ABOVE
    if not collapsed:
        slot: dict[tuple[int, str], int] = {}
        nodes = []
        pos = action_indexes(ep)
        for k, a in enumerate(ep.actions):
            cell = (a.step, a.agent)
            slot[cell] = slot.get(cell, 0) + 1
            nodes.append({**action_row(k, a, pos), "col": col[a.step], "lane": lane[a.agent], "slot": slot[cell] - 1})
        edges = [{"from": d, "to": a.id} for a in ep.actions for d in dict.fromkeys(a.depends_on)]
        rows = {n: 0 for n in ep.agents}
        for (_, agent), n in slot.items():
            rows[agent] = max(rows[agent], n)
        return {"collapsed": False, "steps": steps, "lanes": [{"agent": a, "rows": rows[a]} for a in ep.agents],
                "nodes": nodes, "edges": edges}
    group_of: dict[str, str] = {}
    groups: dict[str, dict] = {}
    for a in ep.actions:
        gid = f"{a.step}/{a.agent}"
        group_of[a.id] = gid
        g = groups.setdefault(gid, {"id": gid, "agent": a.agent, "step": a.step, "col": col[a.step],
                                    "lane": lane[a.agent], "slot": 0, "count": 0, "kinds": {}, "errors": 0})
        g["count"] += 1
        g["kinds"][a.kind] = g["kinds"].get(a.kind, 0) + 1
        g["errors"] += a.error is not None
    for g in groups.values():
        g["kind"] = max(g["kinds"], key=g["kinds"].get)
    pairs: dict[tuple[str, str], int] = {}
    for a in ep.actions:
        for d in dict.fromkeys(a.depends_on):
            key = (group_of[d], group_of[a.id])
            pairs[key] = pairs.get(key, 0) + 1
    edges = [{"from": f, "to": t, "count": n} for (f, t), n in pairs.items() if f != t]
    return {"collapsed": True, "steps": steps, "lanes": [{"agent": a, "rows": 1} for a in ep.agents],
            "nodes": list(groups.values()), "edges": edges}


def episode_view(ep: Episode) -> dict:
    """The episode page: summary, task, rewards with what they credit, and the drawn graph."""
    return {"summary": summarize(ep), "task": ep.task, "metadata": ep.metadata, "credited": credited(ep),
            "graph": graph(ep), "agents": list(ep.agents)}


def action_page(ep: Episode, params: dict[str, str]) -> dict:
    offset = int(params.get("offset") or 0)
    limit = int(params.get("limit") or 100)
    if offset < 0 or not 1 <= limit <= MAX_ACTION_PAGE:
        raise MarftError(f"limit must be 1..{MAX_ACTION_PAGE} and offset >= 0")
    agent, step = params.get("agent"), params.get("step")
    rows = [(k, a) for k, a in enumerate(ep.actions)
            if (not agent or a.agent == agent) and (step in (None, "") or str(a.step) == step)]
    pos = action_indexes(ep)
    return {"total": len(rows), "offset": offset, "limit": limit,
            "items": [action_row(k, a, pos) for k, a in rows[offset:offset + limit]]}


def action_view(ep: Episode, action_id: str, decode=None) -> dict:
    """One action in full (its record as JSON), with its place in D and the rewards crediting it.
    ``decode(ids) -> [text of each id]``, when a tokenizer was given, names the sampled tokens."""
    pos = action_indexes(ep)
    k = pos.get(action_id)
    if k is None:
        raise KeyError(action_id)
    a = ep.actions[k]
    dependants = [b.id for b in ep.actions if action_id in b.depends_on]
    tokens = None
    if a.output.token_ids is not None:
        lps = a.output.logprobs or [None] * len(a.output.token_ids)
        tokens = [{"id": t, "logprob": lp} for t, lp in zip(a.output.token_ids, lps)]
        if decode is not None:
            for tok, text in zip(tokens, decode(a.output.token_ids)):
                tok["text"] = text
    return {"index": k, "record": a.model_dump(mode="json"), "dependants": dependants, "tokens": tokens,
            "indexes": {i: pos[i] for i in [*a.depends_on, *dependants]},
            "rewards": [{k: v for k, v in c.items() if k != "actions"} for c in credited(ep) if action_id in c["actions"]]}
