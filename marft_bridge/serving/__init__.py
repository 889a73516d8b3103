"""Serving: the adapter registry, the embedded OpenAI-compatible multi-LoRA server, and publishers
that hot-swap adapter versions into it, into vLLM, or into an in-process model.

Names resolve lazily so importing the registry does not pull in torch or FastAPI.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AdapterRegistry": "registry",
    "AdapterManifest": "registry",
    "AdapterVersion": "registry",
    "AdapterError": "adapter_files",
    "inspect_adapter": "adapter_files",
    "AdapterEngine": "engine",
    "GenerationResult": "engine",
    "UnknownAdapter": "engine",
    "create_app": "server",
    "Publisher": "publishers",
    "EmbeddedServerPublisher": "publishers",
    "VLLMPublisher": "publishers",
    "InProcessPublisher": "publishers",
    "ServerProcess": "process",
    "free_port": "process",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'marft_bridge.serving' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
