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
    "AdapterEngine": ".engine",
    "GenerationResult": ".engine_types",
    "UnknownAdapter": ".engine_types",
    "RequestError": ".engine_types",
    "QueueFull": ".engine_types",
    "WorkerFault": ".engine_types",
    "HermesParser": ".tool_calls",
    "create_app": ".server",
    "Publisher": ".publishers",
    "EmbeddedServerPublisher": ".publishers",
    "VLLMPublisher": ".publishers",
    "InProcessPublisher": ".publishers",
    "ServerProcess": ".process",
    "free_port": ".process",
    "VLLMServer": ".vllm_server",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
