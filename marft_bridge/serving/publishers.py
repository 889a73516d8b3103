"""Publishers put an adapter version in front of live traffic, behind one interface:

- ``EmbeddedServerPublisher``: a ``marft serve`` process, over HTTP.
- ``VLLMPublisher``: a vLLM OpenAI server with multi-LoRA. Launch it with ``marft vllm serve`` (or
  ``VLLMServer``), or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 vllm serve BASE --enable-lora --max-loras N
  --max-lora-rank R``;
  every version is loaded from its own registry directory (vLLM does not notice changed weights
  under a path it already loaded), and the registry path must be readable by the vLLM process.
  vLLM's responses do not say which version answered: capture reads it from the same registry
  (``marft_bridge.instrument(app, registry=root)`` or ``integrations.openai.use_registry(root)``).
- ``InProcessPublisher``: an application that holds the model itself (an ``AdapterEngine``).

``AdapterRegistry.promote(agent, v, publisher=p)`` loads through the publisher first and marks the
version current only if the server accepted it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Protocol

from ..errors import MarftError
from .adapter_files import AdapterError


class VersionDirs(Protocol):
    """What ``deploy`` reads of a registry (``AdapterRegistry`` is one; the registry imports this
    module, so it is named by its methods)."""

    def current(self, agent: str) -> int | None: ...

    def path(self, agent: str, version: int | None = None) -> Path: ...


class Publisher(ABC):
    """Loads adapter versions into something that serves them."""

    @abstractmethod
    def load(self, name: str, path: str | Path, *, version: int | None = None) -> None:
        """Serve the adapter at ``path`` under ``name``, replacing the one loaded now; raise
        ``AdapterError`` if the server refuses it (the old one then keeps serving)."""

    @abstractmethod
    def unload(self, name: str) -> None:
        """Stop serving ``name``."""

    def deploy(self, registry: VersionDirs, agent: str, version: int | None = None) -> int:
        """Load ``agent``'s version (default: current) from the registry and return its number."""
        version = version if version is not None else registry.current(agent)
        if version is None:
            raise AdapterError(f"agent {agent!r} has no current version to deploy")
        self.load(agent, registry.path(agent, version), version=version)
        return version


class _HTTPPublisher(Publisher):
    def __init__(self, url: str, api_key: str | None = None, *, timeout: float = 60.0):
        url = url.rstrip("/")
        self.url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.api_key = api_key
        self.timeout = timeout

    def _post(self, endpoint: str, payload: dict) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = httpx.post(f"{self.url}/v1/{endpoint}", json=payload, headers=headers, timeout=self.timeout)
        except httpx.HTTPError as e:
            raise MarftError(f"cannot reach the server at {self.url}: {e}") from None
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except Exception:  # noqa: BLE001 - vLLM and proxies answer in other shapes
                message = r.text.strip()[:500]
            cls = AdapterError if self._refused(endpoint, r.status_code, message) else MarftError
            raise cls(f"{endpoint} refused by {self.url} (HTTP {r.status_code}): {message}")

    def _refused(self, endpoint: str, status: int, message: str) -> bool:
        """Whether an error answer refuses the adapter (``AdapterError``) rather than reports a fault."""
        return status in (400, 404)

    def load(self, name: str, path: str | Path, *, version: int | None = None) -> None:
        self._post("load_lora_adapter", {"lora_name": name, "lora_path": str(path), "load_inplace": True})

    def unload(self, name: str) -> None:
        self._post("unload_lora_adapter", {"lora_name": name})


class EmbeddedServerPublisher(_HTTPPublisher):
    """A running ``marft serve`` (it reads the version number from the registry path)."""


class VLLMPublisher(_HTTPPublisher):
    """A vLLM server started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
    (``VLLMServer`` / ``marft vllm serve`` start one so).

    vLLM answers an adapter its worker cannot load (corrupt weights, a rank above
    ``--max-lora-rank``) with HTTP 500 "Call to add_lora method failed: ..." and keeps serving the
    old one: that is a refusal too, raised as ``AdapterError`` like its 400s and 404s."""

    def _refused(self, endpoint: str, status: int, message: str) -> bool:
        return super()._refused(endpoint, status, message) or (
            endpoint == "load_lora_adapter" and status == 500 and "add_lora" in message)


class InProcessPublisher(Publisher):
    """An application holding its model object: anything with ``load_adapter(name, path, version=,
    load_inplace=)`` and ``unload_adapter(name)``, such as ``AdapterEngine``."""

    def __init__(self, model_holder):
        self.holder = model_holder

    def load(self, name: str, path: str | Path, *, version: int | None = None) -> None:
        self.holder.load_adapter(name, path, version=version, load_inplace=True)

    def unload(self, name: str) -> None:
        self.holder.unload_adapter(name)
