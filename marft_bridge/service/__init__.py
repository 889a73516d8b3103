"""Continuous fine-tuning (``marft service``): poll the store → train MARFT → gate → publish → watch →
roll back. See :mod:`marft_bridge.service.loop`. Names resolve lazily."""

from __future__ import annotations

from .._lazy import lazy_getattr


_EXPORTS = {
    "ContinuousService": "marft_bridge.service.loop",
    "heldout": "marft_bridge.service.loop",
    "load_function": "marft_bridge.service.loop",
    "PublisherConfig": "marft_bridge.service.config",
    "ServiceConfig": "marft_bridge.service.config",
    "ServiceJournal": "marft_bridge.service.config",
    "ServiceState": "marft_bridge.service.config",
    "STATE_FILE": "marft_bridge.service.config",
    "DECISIONS_FILE": "marft_bridge.service.config",
    "JOURNAL_FILE": "marft_bridge.service.config",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
