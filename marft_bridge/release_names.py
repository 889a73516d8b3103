"""Team-release names shared by capture (which routes an episode's calls) and serving (which stores
releases and serves them): a release id ``r<N>``, the served name ``<agent>@r<N>`` of a release's
adapter, the sticky canary split, and where a registry keeps its releases. Standard library only."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from .registry_state import is_agent_name

RELEASES_DIR = ".releases"  # <registry>/.releases: not an agent name (leading dot), so never an agent
ROUTING_FILE = "routing.json"
RELEASE_ID = re.compile(r"^r[1-9][0-9]{0,8}\Z")
SEP = "@"


def served_name(agent: str, release: str) -> str:
    """The name a release's adapter of ``agent`` is served under: ``planner@r12``."""
    return f"{agent}{SEP}{release}"


def split_served_name(name: str) -> tuple[str, str | None]:
    """``planner@r12`` -> (``planner``, ``r12``); a plain adapter name -> (name, None). Raises
    ``ValueError`` for a name with ``@`` whose parts are not an adapter name and a release id."""
    agent, sep, release = name.partition(SEP)
    if not sep:
        return name, None
    if not is_agent_name(agent) or not RELEASE_ID.match(release):
        raise ValueError(f"{name!r} is not a served release name <agent>@r<N>")
    return agent, release


def in_canary(episode_id: str, release: str, fraction: float) -> bool:
    """Whether ``episode_id`` belongs to the canary share of ``release`` (a stable hash: the same
    episode always gets the same answer, in every process and after restarts)."""
    h = int.from_bytes(hashlib.sha256(f"{release}:{episode_id}".encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def routing_path(root: str | os.PathLike) -> Path:
    return Path(root) / RELEASES_DIR / ROUTING_FILE


def served_versions(ep: Any) -> dict[str, int]:
    """{adapter: version} of an episode's model calls that name an adapter version."""
    return {a.policy.name: a.policy.version for a in ep.actions
            if a.kind == "llm" and a.policy is not None and a.policy.version is not None}


def release_for(pinned: Any, served: dict[str, int], candidates: dict[str, dict[str, int]]) -> str | None:
    """The release that served an episode: ``pinned`` (the release capture recorded) when it is a
    release id, else the newest of ``candidates`` whose versions served every call in ``served``."""
    if isinstance(pinned, str) and RELEASE_ID.match(pinned):
        return pinned
    for rid, versions in sorted(candidates.items(), key=lambda kv: -int(kv[0][1:])):
        if served and all(versions.get(name) == v for name, v in served.items()):
            return rid
    return None


def release_of(ep: Any, candidates: dict[str, dict[str, int]]) -> str | None:
    """``release_for`` an episode (its ``Episode.release``, else its metadata's ``release``)."""
    pinned = getattr(ep, "release", None) or (ep.metadata or {}).get("release")
    return release_for(pinned, served_versions(ep), candidates)


__all__ = ["RELEASES_DIR", "RELEASE_ID", "ROUTING_FILE", "SEP", "in_canary", "release_for", "release_of",
           "routing_path", "served_name", "served_versions", "split_served_name"]
