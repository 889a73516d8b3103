"""Where ``fit``'s adapters are served: the embedded server it starts and stops (127.0.0.1, a random key),
or a running server (``--server URL``: vLLM, loaded through the vLLM publisher)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from ..errors import MarftError


class Serving:
    """``with Serving(...) as s``: ``s.url``, ``s.api_key``, ``s.publisher``."""

    def __init__(self, base_model: str | Path, registry: Any, *, server: str | None = None,
                 api_key: str | None = None, api_key_env: str | None = None, publisher: str = "vllm",
                 start_timeout: float = 120.0):
        self.base_model, self.registry = base_model, registry
        self.server, self.kind, self.start_timeout = server, publisher, start_timeout
        if api_key_env and not server:
            raise MarftError("--api-key-env goes with --server (the embedded server gets a random key)")
        if api_key_env:
            api_key = os.environ.get(api_key_env)
            if not api_key:
                raise MarftError(f"--api-key-env {api_key_env}: that environment variable is not set")
        self.api_key = api_key
        self.process = None
        self.url = server
        self.publisher = None

    def __enter__(self) -> Serving:
        from ..serving.publishers import EmbeddedServerPublisher, VLLMPublisher

        if self.server is None:
            from ..serving.process import ServerProcess

            self.api_key = secrets.token_hex(16)
            self.process = ServerProcess(self.base_model, self.registry, api_key=self.api_key).start(
                timeout=self.start_timeout)
            self.url = self.process.url
            self.publisher = EmbeddedServerPublisher(self.url, self.api_key)
        else:
            kinds = {"vllm": VLLMPublisher, "embedded": EmbeddedServerPublisher}
            if self.kind not in kinds:
                raise MarftError(f"publisher {self.kind!r}: expected one of {sorted(kinds)}")
            self.publisher = kinds[self.kind](self.server, self.api_key)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.process is not None:
            self.process.stop()
