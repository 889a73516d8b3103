"""Capture integrations, one folder per framework, each an instrumentor in the OpenTelemetry manner:
``instrument()`` / ``uninstrument()`` idempotent and restoring (``instrument_client`` /
``instrument_server`` where capture is per object), public extension points before private
internals, never raising into the app.

``INTEGRATIONS`` is the one table of them: the integration's name, its module, the distribution it
captures, the version range its hooks on private internals were checked against (None: public
extension points only) and when a ``marft_bridge.episode`` / ``capture`` block instruments it
itself (``session``: "installed" — whenever the library is installed; "imported" — only once the app
has imported it, since importing it costs seconds; None — the app instruments it, per app or object).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Version = tuple[int, ...]


@dataclass(frozen=True)
class Integration:
    name: str
    module: str
    distribution: str
    supported: tuple[Version, Version] | None  # [low, high)
    session: Literal["installed", "imported"] | None = None
    import_name: str | None = None  # the library's top-level module (for ``session``)


INTEGRATIONS: tuple[Integration, ...] = (
    Integration("langgraph", "marft_bridge.integrations.langgraph", "langgraph", ((1, 0), (1, 3))),
    Integration("openai", "marft_bridge.integrations.openai", "openai", ((1, 40), (4, 0)),
                session="installed", import_name="openai"),
    Integration("openai_agents", "marft_bridge.integrations.openai_agents", "openai-agents", None,
                session="imported", import_name="agents"),
    Integration("mcp", "marft_bridge.integrations.mcp", "mcp", ((1, 21, 2), (3, 0))),
    Integration("a2a", "marft_bridge.integrations.a2a", "a2a-sdk", None),
    Integration("otel", "marft_bridge.integrations.otel", "opentelemetry-sdk", None),
)

BY_NAME = {i.name: i for i in INTEGRATIONS}


def checked_range(name: str) -> tuple[Version, Version] | None:
    """The checked version range of integration ``name`` (its hooks' ``SUPPORTED``)."""
    return BY_NAME[name].supported
