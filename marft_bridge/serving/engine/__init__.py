"""The embedded multi-LoRA engine: one base model, adapter slots swapped in place, continuous batching,
vLLM-style sampling. ``import marft_bridge.serving.engine`` stays cheap: names resolve on first use,
and torch is imported only when an engine is built."""

from __future__ import annotations

from ..._lazy import lazy_getattr

_EXPORTS = {
    "AdapterEngine": ".engine",
    "DEFAULT_MAX_QUEUED": ".types",
    "MAX_SEED": ".types",
    "GenerationRequest": ".types",
    "GenerationResult": ".types",
    "TokenEvent": ".types",
    "UnknownAdapter": ".types",
    "RequestError": ".types",
    "QueueFull": ".types",
    "WorkerFault": ".types",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
