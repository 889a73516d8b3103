"""Typed seams at the wings' borders: what one wing needs of an object another wing builds, as a
``typing.Protocol``, so a wing can name the type without importing the wing that builds it.

- ``LiveVersions``: capture's view of the adapter registry (which version of an adapter is live),
  and ``RegistryRef``, what ``registry=`` accepts wherever capture is set up.
"""

from __future__ import annotations

import os
from typing import Protocol, Union, runtime_checkable


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
