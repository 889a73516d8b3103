"""Which team release serves an episode: the capture side of a canary.

A *release* (``marft_bridge.serving.releases``) is an immutable set {agent: adapter version}. While a
canary runs, the service writes a routing table to ``<registry>/.releases/routing.json``::

    {"stable": {"id": "r11", "versions": {"planner": 3, "coder": 2}},
     "canary": {"id": "r12", "versions": {"planner": 4, "coder": 2}, "fraction": 0.1}}

and loads each listed release into the servers under *served names* ``<agent>@<release>``
(``planner@r12``); with no canary the table is empty and nothing is routed. The client hook asks ``route`` before a model call goes out: the first call of an
episode pins it to a release — the canary when its id hashes into ``fraction`` (sticky: the same id
always lands on the same side), else the stable one — and every later call of that episode goes to
the same release's served names, so no episode ever mixes releases, even across a promotion. The
pin is kept on the episode's recorder: ``release`` (recorded as ``Episode.release``), and a
registry view that answers the release's versions, so each action's recorded adapter version is the
one the release serves. The app's code does not change: it still sends ``model="planner"``.

Capture reads the table as a file, re-read only when it changes; nothing of serving is imported.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from ..registry_state import live_versions
from ..release_names import RELEASE_ID, RELEASES_DIR, ROUTING_FILE, in_canary, routing_path, served_name
from ..release_names import split_served_name  # noqa: F401 - re-exported


class RoutingTable:
    """``routing.json`` of one registry, re-read when the file changes (stat key, like ``LiveVersions``)."""

    def __init__(self, root: Path) -> None:
        self.path = routing_path(root)
        self._key: tuple | None = None
        self._table: dict = {}

    def read(self) -> dict:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._key, self._table = None, {}
            return {}
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key != self._key:
            self._table, self._key = json.loads(self.path.read_text()), key
        return self._table


_TABLES: dict[Path, RoutingTable] = {}
_LOCK = threading.Lock()


def table_for(root: str | os.PathLike) -> RoutingTable:
    key = Path(root).expanduser().resolve()
    with _LOCK:
        hit = _TABLES.get(key)
        if hit is None:
            hit = _TABLES[key] = RoutingTable(key)
        return hit


class ReleaseView:
    """The registry as a pinned episode sees it: the release's version for its agents, the
    underlying registry's live version for any other name."""

    def __init__(self, release: str, versions: dict[str, int], under: Any) -> None:
        self.release, self.versions, self.under = release, dict(versions), under

    def live_version(self, agent: str) -> int | None:
        if agent in self.versions:
            return self.versions[agent]
        return self.under.live_version(agent) if self.under is not None else None


def _root_of(registry: Any) -> Path | None:
    live = live_versions(registry) if registry is not None else None
    root = getattr(live, "root", None)
    return Path(root) if isinstance(root, (str, os.PathLike)) else None


def _choose(table: dict, episode_id: str) -> dict | None:
    canary, stable = table.get("canary"), table.get("stable")
    if canary and in_canary(episode_id, canary["id"], float(canary.get("fraction", 0.0))):
        return canary
    return stable or None


def pin(rec: Any, registry: Any) -> ReleaseView | None:
    """The release ``rec``'s episode is pinned to; the first call of an episode pins it (see the
    module docstring). None when the registry has no routing table."""
    view = getattr(rec, "registry", None)
    if isinstance(view, ReleaseView):
        return view
    root = _root_of(view if view is not None else registry)
    if root is None:
        return None
    chosen = _choose(table_for(root).read(), rec.id)
    if chosen is None:
        return None
    under = live_versions(view if view is not None else registry)
    view = ReleaseView(chosen["id"], {a: int(v) for a, v in chosen["versions"].items()}, under)
    rec.registry = view  # later calls of this episode, and the version reads of this one, see the release
    rec.release = chosen["id"]  # ``Episode.release``
    rec.metadata["release"] = chosen["id"]
    return view


def route(body: Any, rec: Any, registry: Any) -> dict | None:
    """The request body to send instead of ``body`` (``model`` = the pinned release's served name),
    or None to send ``body`` unchanged (no episode, no routing table, or a model the release lacks)."""
    if rec is None or not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return None
    view = pin(rec, registry)
    if view is None or body["model"] not in view.versions:
        return None
    return {**body, "model": served_name(body["model"], view.release)}


__all__ = ["ROUTING_FILE", "RELEASES_DIR", "RELEASE_ID", "ReleaseView", "in_canary", "pin", "route",
           "routing_path", "served_name", "split_served_name", "table_for"]
