"""Typed seams at the wings' borders: what one wing needs of an object another wing builds, as a
``typing.Protocol``, so a wing can name the type without importing the wing that builds it.

- ``EpisodeSink``: where capture hands finished episodes and late rewards (``store.TraceStore`` is
  one; so is a cross-process callee's half store).
- ``LiveVersions``: capture's view of the adapter registry (which version of an adapter is live),
  and ``RegistryRef``, what ``registry=`` accepts wherever capture is set up.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, Union, runtime_checkable


@runtime_checkable
class EpisodeSink(Protocol):
    """What capture needs of a store: take a finished episode (validated there, a bad record kept as
    a dead letter), and a reward that arrives after its episode was handed over."""

    def submit(self, episode: Any) -> None:
        """Store ``episode`` (an ``Episode``, or its JSON dict); may queue it for a background writer."""
        ...

    def add_reward(self, episode_id: str, value: float, agent: str | None = None, action_id: str | None = None,
                   source: str = "user") -> Any:
        ...


@runtime_checkable
class LiveVersions(Protocol):
    """Which version of each adapter is live now: capture labels a call that its server did not
    label with it. ``serving.AdapterRegistry`` and ``registry_state.LiveVersions`` (the cached
    state-file reader capture uses) are ones."""

    def live_version(self, agent: str) -> int | None:
        """``agent``'s live version; None for an adapter the registry does not manage."""
        ...


# What ``registry=`` takes (``episode``, ``instrument``, ``use_registry``): a registry root
# directory, or anything with ``live_version`` (``registry_state.live_versions`` resolves it).
RegistryRef = Union[str, os.PathLike, LiveVersions]
