"""The viewer's Releases panel: per team release and per agent, the live reward of the episodes the
release served (with its always-valid 95% interval, as ``marft service status`` computes it) beside
the gate score it was promoted on, flagged when the live mean is below the gate score by more than
a margin (``drift_margin`` in the service config; 0.1 there and here by default).

An episode counts for the release capture pinned it to (``Episode.release``), else for the newest
release whose versions served every adapter call of it; its live reward is its team reward. Per
agent: the episodes of that release in which the agent acted, against the gate score of the
agent's version (its manifest's ``eval_score``, else the release's).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ..always_valid import mean_interval
from ..release_names import release_for, served_versions

ALPHA = 0.05  # a 95% interval
TAU = 0.1  # the mixture's scale: the service's default canary ``effect``
DEFAULT_MARGIN = 0.1  # the service's default ``drift_margin``


class LiveRewards:
    """Per rewarded episode: (pinned release, team reward, {adapter: version} served, agents that
    acted), read from the store once and then kept current from its change log."""

    def __init__(self, store):
        self.store = store
        self._lock = threading.Lock()
        self._rows: dict[str, tuple] | None = None
        self._cursor = 0

    @staticmethod
    def _row(ep) -> tuple | None:
        reward = ep.team_reward()
        if reward is None:
            return None
        return ep.release or (ep.metadata or {}).get("release"), float(reward), served_versions(ep), \
            {a.agent for a in ep.actions}

    def rows(self) -> list[tuple]:
        with self._lock:
            if self._rows is None:
                self._cursor, self._rows = self.store.cursor(), {}
                for ep in self.store.episodes():
                    self._put(ep.id, self._row(ep))
            while True:
                cursor, ids = self.store.changed_since(self._cursor, limit=1000)
                if not ids:
                    break
                for eid in ids:
                    try:
                        self._put(eid, self._row(self.store.get_episode(eid, exact=True)))
                    except KeyError:  # the store's EpisodeNotFound: not stored any more
                        self._rows.pop(eid, None)
                self._cursor = cursor
            return list(self._rows.values())

    def _put(self, eid: str, row: tuple | None) -> None:
        if row is None:
            self._rows.pop(eid, None)
        else:
            self._rows[eid] = row


def _live(rewards: list[float], gate: float | None, margin: float) -> dict:
    iv = mean_interval(rewards, ALPHA, TAU)
    mean = iv[0] if iv else (rewards[0] if rewards else None)
    return {"n": len(rewards), "live_reward": mean, "interval": [iv[1], iv[2]] if iv else None,
            "gate_score": gate, "drifted": bool(iv and gate is not None and iv[0] < gate - margin)}


def releases_view(registry_dir: Path | None, live: LiveRewards | None, margin: float = DEFAULT_MARGIN) -> dict:
    """Per release (newest first): its versions, stable/canary, and the live reward against the gate
    score for the team and for each agent."""
    out: dict[str, Any] = {"registry": str(registry_dir) if registry_dir else None, "margin": margin,
                           "alpha": ALPHA, "stable": None, "canary": None, "releases": [], "problems": []}
    if registry_dir is None or not (registry_dir / ".releases").is_dir():
        return out  # no releases yet: nothing to read (and no store scan)
    from ..serving.registry import AdapterRegistry
    from ..serving.releases import ReleaseStore

    registry = AdapterRegistry(registry_dir)
    store = ReleaseStore(registry)
    try:
        rels, state = store.list(), store.state()
    except Exception as e:  # noqa: BLE001 - a hand-edited release file: say so, show the rest of the page
        out["problems"].append(f"releases: {e}")
        return out
    out["stable"], out["canary"] = state.stable, (state.canary or {}).get("id")
    by_release: dict[str, list[tuple]] = {}
    for row in (live.rows() if live is not None else []):
        rid = release_for(row[0], row[2], {r.id: r.versions for r in rels})
        if rid is not None:
            by_release.setdefault(rid, []).append(row)
    for rel in reversed(rels):
        rows = by_release.get(rel.id, [])
        agents = []
        for agent, version in sorted(rel.versions.items()):
            gate = rel.gate_score
            try:
                gate = registry.manifest(agent, version).metrics.get("eval_score", gate)
            except Exception as e:  # noqa: BLE001 - a version removed by hand: the release's score stands
                out["problems"].append(f"{rel.id}: {agent} v{version}: {e}")
            agents.append({"agent": agent, "version": version,
                           **_live([r[1] for r in rows if agent in r[3]], gate, margin)})
        out["releases"].append({"release": rel.id, "versions": rel.versions, "parent": rel.parent,
                                "round": rel.round, "created_at": rel.created_at, "created_by": rel.created_by,
                                "stable": rel.id == state.stable, "canary": rel.id == out["canary"],
                                **_live([r[1] for r in rows], rel.gate_score, margin), "agents": agents})
    return out
