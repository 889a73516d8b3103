"""Serving: the adapter registry, the embedded OpenAI-compatible multi-LoRA server, and publishers
that hot-swap adapter versions into it, into vLLM, or into an in-process model.

Names resolve lazily so importing the registry does not pull in torch or FastAPI.
"""

from __future__ import annotations

from .._lazy import lazy_getattr


_EXPORTS = {
    "AdapterRegistry": ".registry",
    "AdapterManifest": ".registry",
    "AdapterVersion": ".registry",
    "AdapterError": ".adapter_files",
    "inspect_adapter": ".adapter_files",
    "AdapterEngine": ".engine.engine",
    "GenerationResult": ".engine.types",
    "UnknownAdapter": ".engine.types",
    "RequestError": ".engine.types",
    "QueueFull": ".engine.types",
    "WorkerFault": ".engine.types",
    "HermesParser": ".http.tool_calls",
    "create_app": ".http.server",
    "Publisher": ".publishers",
    "EmbeddedServerPublisher": ".publishers",
    "VLLMPublisher": ".publishers",
    "InProcessPublisher": ".publishers",
    "ManagedServer": ".process",
    "ServerProcess": ".process",
    "free_port": ".process",
    "VLLMServer": ".vllm.server",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
