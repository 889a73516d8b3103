"""Read an adapter registry's live versions without importing the registry (or torch, or pydantic).

The registry (``marft_bridge.serving.registry``) keeps one ``<root>/<agent>/state.json`` per agent
with ``{"current": <version or null>, "history": [...]}``. Capture only needs "which version of
adapter X is live right now"; this module is that reader, so integrations never import serving.

``live_versions(registry)`` turns what a user passes as ``registry=`` (a root directory, an
``AdapterRegistry`` or anything with a ``root``, or any object with ``live_version(agent)``) into
an object with ``live_version(agent) -> int | None``; a root gets one shared ``RegistryStateReader``
(its cache is per root, so several apps on one registry share it).
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

from . import seams

STATE_FILE = "state.json"
# Adapter (agent) names the registry holds and vLLM serves; the one definition (``adapter_names``
# re-exports it as ADAPTER_NAME). ``\Z``, not ``$``: ``$`` also matches before a final newline, and
# "planner\n" is not "planner".
AGENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


def is_agent_name(name: Any) -> bool:
    """Whether ``name`` is one the registry can hold: ``AGENT_NAME``, matched whole, and no ``..``."""
    return isinstance(name, str) and AGENT_NAME.match(name) is not None and ".." not in name


def state_path(root: str | os.PathLike, agent: str) -> Path | None:
    """Where ``agent``'s state file lives; None for a name the registry cannot hold."""
    if not is_agent_name(agent):
        return None
    return Path(root) / agent / STATE_FILE


def read_state_file(path: Path) -> dict:
    """A state file's content; an agent never promoted has none (``current`` None)."""
    if not path.is_file():
        return {"current": None, "history": []}
    return json.loads(path.read_text())


class RegistryStateReader:
    """The live version of each agent in one adapter registry, re-read only when its state file changes.

    Race: the capture reads the version when the request goes out. ``promote`` (and ``rollback``)
    loads into the server first and writes the state file after, so a version read there is already
    being served; a request sent between the load and the state write is labelled with the previous
    version although the new one may answer it. The window is that gap (milliseconds) per swap,
    not a request's latency; in-flight requests keep the version they were sent under.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser().resolve()
        self._cache: dict[str, tuple[tuple[int, int, int], int | None]] = {}

    def live_version(self, agent: str) -> int | None:
        """``agent``'s live version; None for a name the registry does not manage. Raises if the
        registry is missing or its state unreadable."""
        path = state_path(self.root, agent)
        if path is None:  # e.g. "org/base-model": not an adapter of ours
            return None
        try:
            st = path.stat()
        except FileNotFoundError:
            if not self.root.is_dir():
                raise FileNotFoundError(f"adapter registry {self.root} does not exist") from None
            return None  # never promoted, or not an agent of this registry
        # Size and inode too: two writes within one timestamp tick still differ in them
        # (every promote appends to the history, every rollback drops from it; each write is a new file).
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        hit = self._cache.get(agent)
        if hit is None or hit[0] != key:
            hit = self._cache[agent] = (key, read_state_file(path)["current"])
        return hit[1]

    get = live_version  # the name this reader had before


_BY_ROOT: dict[Path, RegistryStateReader] = {}
_LOCK = threading.Lock()


def live_versions(registry: seams.RegistryRef | None) -> seams.LiveVersions | None:
    """An object with ``live_version(agent)`` for ``registry`` (see the module docstring)."""
    if registry is None:
        return None
    if not isinstance(registry, (str, os.PathLike)):
        if callable(getattr(registry, "live_version", None)):
            return registry
        root = getattr(registry, "root", None)  # an AdapterRegistry (a Path has ``root`` too: a str)
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"registry must be a directory, an AdapterRegistry or have live_version(agent); "
                            f"got {type(registry).__name__}")
        registry = root
    key = Path(registry).expanduser().resolve()
    with _LOCK:
        hit = _BY_ROOT.get(key)
        if hit is None:
            hit = _BY_ROOT[key] = RegistryStateReader(key)
        return hit


__all__ = ["AGENT_NAME", "STATE_FILE", "LiveVersions", "RegistryStateReader", "is_agent_name", "live_versions", "read_state_file",
           "state_path"]

# The reader's name until 0.1: ``seams.LiveVersions`` is now the protocol it satisfies.
LiveVersions = RegistryStateReader
