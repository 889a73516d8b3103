"""Start ``marft serve`` as a subprocess on a free port, wait until it answers, stop it by its pid."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import MarftError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``with ServerProcess(base, registry, api_key="k") as srv: OpenAI(base_url=srv.base_url, ...)``."""

    def __init__(
        self,
        base_model: str | Path,
        registry,  # a path or an AdapterRegistry
        *,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ):
        from .registry import AdapterRegistry

        if isinstance(registry, AdapterRegistry):
            registry = registry.root
        self.base_model, self.registry, self.api_key = str(base_model), str(registry), api_key
        self.host, self.port = host, port
        self.extra_args = list(extra_args or [])
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, timeout: float = 120.0) -> ServerProcess:
        import httpx

        if self.port is None:
            self.port = free_port(self.host)
        cmd = [sys.executable, "-m", "marft_bridge", "serve", "--base-model", self.base_model,
               "--registry", self.registry, "--host", self.host, "--port", str(self.port), *self.extra_args]
        env = {**os.environ, **(self.env or {})}
        if self.api_key:
            env["MARFT_API_KEY"] = self.api_key  # not on the command line, where `ps` would show it
        fd, log = tempfile.mkstemp(prefix="marft-serve-", suffix=".log")
        self.log_path = Path(log)
        with os.fdopen(fd, "wb") as log_file:
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MarftError(f"marft serve exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise MarftError(f"marft serve did not answer within {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path and self.log_path.exists() else ""

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the process this object started (by pid), killing it if it does not exit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
