"""``marft fit``: train the agents of your own app on a task set (``marft_bridge.fit``). Names resolve lazily."""

from __future__ import annotations

from .._lazy import lazy_getattr

_EXPORTS = {
    "fit": "marft_bridge.fitting.loop",
    "Endpoint": "marft_bridge.fitting.endpoint",
    "current_seed": "marft_bridge.fitting.endpoint",
    "FitSettings": "marft_bridge.fitting.settings",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
