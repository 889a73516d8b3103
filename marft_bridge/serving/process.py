"""A server run as a subprocess: started on a free port, waited on until ``/health`` answers, stopped
by the pid (or process group) this object started. ``ManagedServer`` holds that lifecycle;
``ServerProcess`` (``marft serve``) and ``VLLMServer`` (``serving/vllm/server.py``) only say which
command runs, in which environment."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..errors import MarftError

if TYPE_CHECKING:
    from .registry import AdapterRegistry

S = TypeVar("S", bound="ManagedServer")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ManagedServer(ABC):
    """The shared lifecycle. A subclass sets ``name`` (for messages), ``log_prefix`` and the
    timing attributes, and defines ``command()`` and ``environment()``."""

    name = "server"
    log_prefix = "marft-server-"
    own_process_group = False  # True: stop() signals the whole group (a server that forks workers)
    health_timeout_s = 1.0
    poll_interval_s = 0.1
    stop_timeout_s = 10.0
    slow_start_hint = ""  # appended to the "did not become ready" message

    def __init__(self, *, host: str, port: int | None, api_key: str | None, extra_args: list[str] | None,
                 log_path: str | os.PathLike | None = None):
        self.host, self.port, self.api_key = host, port, api_key
        self.extra_args = list(extra_args or [])
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None  # process start -> /health 200

    @abstractmethod
    def command(self) -> list[str]:
        """The command line (``self.port`` is set by the time ``start`` calls this)."""

    @abstractmethod
    def environment(self) -> dict[str, str]:
        """The child's whole environment."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self: S, timeout: float = 120.0, progress: Callable[[str], None] | None = None,
              progress_every_s: float = 30.0) -> S:
        """Start the process and wait until ``/health`` answers 200. ``progress`` gets a line now and
        then (elapsed time, the log's last line). Raises ``MarftError`` with the log's tail if the
        process exits or is not ready within ``timeout`` seconds (then it is stopped)."""
        if self.proc is not None:
            raise MarftError(f"this {type(self).__name__} was started already")
        if self.port is None:
            self.port = free_port(self.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            # With a session of its own, the server's worker processes join its process group, so
            # stop() ends all of them through the one pid this object started.
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                         start_new_session=self.own_process_group)
        if progress:
            progress(f"{self.name} started from {self.command()[0]} (pid {self.proc.pid}); log: {self.log_path}")
        self._wait_ready(t0, timeout, progress, progress_every_s)
        return self

    def _wait_ready(self, t0: float, timeout: float, progress: Callable[[str], None] | None,
                    progress_every_s: float) -> None:
        import httpx

        next_report = t0 + progress_every_s
        while True:
            if self.proc.poll() is not None:
                raise MarftError(f"{self.name} exited with code {self.proc.returncode} while starting "
                                 f"(log: {self.log_path}):\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=self.health_timeout_s).status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    return
            except httpx.HTTPError:
                pass
            now = time.monotonic()
            if now - t0 > timeout:
                self.stop()
                raise MarftError(f"{self.name} did not become ready within {timeout:.0f} s{self.slow_start_hint}. "
                                 f"Log: {self.log_path}; its tail:\n{self.log_tail()}")
            if progress and now >= next_report:
                progress(f"{self.name} starting, {now - t0:.0f} s: {self.last_log_line()}")
                next_report = now + progress_every_s
            time.sleep(self.poll_interval_s)

    def log_tail(self, chars: int = 4000) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def last_log_line(self) -> str:
        lines = [line for line in self.log_tail(2000).splitlines() if line.strip()]
        return lines[-1][-200:] if lines else "(no output yet)"

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM to what this object started (its pid, or its process group), SIGKILL to what is
        left of it after ``timeout`` seconds."""
        if self.proc is None:
            return
        timeout = self.stop_timeout_s if timeout is None else timeout
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.own_process_group:  # the group's children may outlive the leader a little
            deadline = time.monotonic() + 10
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        if self.proc.poll() is None or (self.own_process_group and _group_alive(self.proc.pid)):
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout)

    def _signal(self, sig: int) -> None:
        if not self.own_process_group:
            self.proc.send_signal(sig)
            return
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session: the group's id is the pid we started
        except ProcessLookupError:
            pass

    def __enter__(self: S) -> S:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal is still a member
        return True
    return True


class ServerProcess(ManagedServer):
    """``marft serve`` as a subprocess:
    ``with ServerProcess(base, registry, api_key="k") as srv: OpenAI(base_url=srv.base_url, ...)``.
    With ``exit_with_parent`` (the default) the server stops itself when this process dies without
    stopping it."""

    name = "marft serve"
    log_prefix = "marft-serve-"
    slow_start_hint = " (loading the base model; marft fit: raise --server-start-timeout)"

    def __init__(
        self,
        base_model: str | Path,
        registry: str | os.PathLike | AdapterRegistry,
        *,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        exit_with_parent: bool = True,
    ):
        from .registry import AdapterRegistry

        super().__init__(host=host, port=port, api_key=api_key, extra_args=extra_args)
        if isinstance(registry, AdapterRegistry):
            registry = registry.root
        self.base_model, self.registry = str(base_model), str(registry)
        self.env, self.exit_with_parent = env, exit_with_parent

    def command(self) -> list[str]:
        return [sys.executable, "-m", "marft_bridge", "serve", "--base-model", self.base_model,
                "--registry", self.registry, "--host", self.host, "--port", str(self.port), *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **(self.env or {})}
        if self.api_key:
            env["MARFT_API_KEY"] = self.api_key  # not on the command line, where `ps` would show it
        if self.exit_with_parent:
            env[PARENT_ENV] = str(os.getpid())
        else:
            env.pop(PARENT_ENV, None)  # not one inherited from whoever started this process
        return env


PARENT_ENV = "MARFT_EXIT_WITH_PARENT"


def exit_with_parent(poll_s: float = 1.0) -> None:
    """In a server started by ``ServerProcess``: SIGTERM to itself once the process that started it is
    gone (killed with -9, say, so its ``stop()`` never ran), rather than serving on as an orphan. POSIX
    (``getppid`` changes when a process is re-parented)."""
    import threading

    parent = os.environ.get(PARENT_ENV, "")
    if not parent.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(poll_s)
        try:
            print(f"marft serve: the process that started it (pid {parent}) is gone; stopping", file=sys.stderr,
                  flush=True)
        finally:  # stderr may be gone with the parent
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="marft-exit-with-parent", daemon=True).start()
