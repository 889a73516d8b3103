"""MARFT trainer: per-agent LoRA adapters on one base model, trained with multi-agent PPO and a
sequential trust-region update from Flex-POMDP episodes (stored traces or fresh rollouts).

Never imports LangGraph, MCP or A2A. Names resolve lazily so importing this package stays cheap::

    from marft_bridge.trainers import MarftConfig, MarftTrainer
"""

from __future__ import annotations

from .._lazy import lazy_getattr


_EXPORTS = {
    "MarftConfig": "marft_bridge.trainers.config",
    "MarftTrainer": "marft_bridge.trainers.marft",
    "RolloutPolicy": "marft_bridge.trainers.rollout",
    "evaluate": "marft_bridge.trainers.rollout",
    "mean_return": "marft_bridge.trainers.rollout",
    "load_episodes": "marft_bridge.trainers.sources",
    "plot_metrics": "marft_bridge.trainers.plot",
    "sft": "marft_bridge.trainers.supervised",
    "SftConfig": "marft_bridge.trainers.supervised",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
