"""``marft vllm serve``: a real vLLM multi-LoRA server on a base model and the registry's current
adapter versions, started from vLLM's own environment with the flags this project is tested with."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys

from ...errors import MarftError
from .server import PYTHON_ENV, STARTUP_TIMEOUT_S, VLLMServer


def add_commands(sub) -> None:
    p = sub.add_parser("vllm", help="run vLLM (its own environment, `make vllm`) as the multi-LoRA server",
                       description="vLLM as the serving engine: it runs from the interpreter of its own "
                       "environment (vLLM pins its own torch and transformers) and is reached over HTTP.")
    vsub = p.add_subparsers(dest="vllm_command", metavar="ACTION", required=True)
    s = vsub.add_parser(
        "serve",
        help="start vLLM on a base model with the registry's current adapters and runtime hot-swap",
        description="Start vLLM's OpenAI server on 127.0.0.1 with runtime LoRA loading "
        "(`marft adapters promote AGENT V --vllm URL` hot-swaps a version), processed log-probs, Hermes tool "
        "calls and float32; every agent's current registry version is loaded under the agent's name. "
        "Waits until vLLM is ready (≈ 3 min on two busy CPU cores), prints its URL, and stops vLLM and its "
        "worker processes on Ctrl-C. Arguments after `--` go to vLLM unchanged.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s.add_argument("--base-model", required=True, help="local transformers model directory")
    s.add_argument("--registry", default=os.environ.get("MARFT_REGISTRY", ".marft/adapters"),
                   help="adapter registry whose current versions are loaded at startup (env MARFT_REGISTRY)")
    s.add_argument("--python", default=None,
                   help=f"interpreter of the vLLM environment (default: ${PYTHON_ENV}, else .venv-vllm/bin/python)")
    s.add_argument("--served-model-name", default=None, help="name of the base model in requests (default: its directory name)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    s.add_argument("--port", type=int, default=8001)
    s.add_argument("--api-key", default=None, help="key required on /v1 (also env MARFT_API_KEY); passed to vLLM "
                   "as VLLM_API_KEY, not on its command line")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="float32 keeps batched greedy decoding equal to single requests on CPU")
    s.add_argument("--max-model-len", type=int, default=1024, help="context length (prompt + output tokens)")
    s.add_argument("--max-loras", type=int, default=4, help="adapters in one batch")
    s.add_argument("--max-lora-rank", type=int, default=16, help="vLLM refuses adapters of a higher rank")
    s.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache size (VLLM_CPU_KVCACHE_SPACE)")
    s.add_argument("--no-tool-parser", action="store_true", help="do not parse Hermes tool calls")
    s.add_argument("--log", default=None, help="vLLM's log file (default: a temporary file, named on start)")
    s.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S, help="seconds to wait for readiness")
    s.add_argument("--print-command", action="store_true", help="print vLLM's command line and exit")
    s.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then arguments passed to vLLM")
    s.set_defaults(func=_serve)


def _current_adapters(registry_root: str) -> dict[str, str]:
    from ..registry import AdapterRegistry

    reg = AdapterRegistry(registry_root)
    out = {}
    for agent in reg.agents():
        if reg.current(agent) is not None:
            out[agent] = str(reg.path(agent, reg.current(agent)))
    return out


def _serve(args) -> int:
    if not os.path.isdir(args.base_model):
        raise MarftError(f"--base-model {args.base_model} is not a model directory")
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    adapters = _current_adapters(args.registry) if os.path.isdir(args.registry) else {}
    server = VLLMServer(
        os.path.abspath(args.base_model), python=args.python, served_model_name=args.served_model_name,
        lora_modules={a: os.path.abspath(p) for a, p in adapters.items()},
        api_key=args.api_key or os.environ.get("MARFT_API_KEY") or None, host=args.host, port=args.port,
        dtype=args.dtype, max_model_len=args.max_model_len, max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank, tool_parser=None if args.no_tool_parser else "hermes",
        kv_cache_gib=args.kv_cache_gib, extra_args=extra, log_path=args.log,
    )
    if args.print_command:
        print(shlex.join(server.command()))
        return 0
    for agent, path in adapters.items():
        _say(f"{agent} <- {path}")
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.start(timeout=args.startup_timeout, progress=_say)
        _say(f"{server.served_model_name} on {server.base_url} (ready after {server.startup_s:.0f} s; "
            f"log: {server.log_path}); Ctrl-C stops it")
        rc = server.proc.wait()
        raise MarftError(f"vLLM exited with code {rc} (log: {server.log_path}):\n{server.log_tail()}")
    finally:
        server.stop()


def _say(line: str) -> None:
    print(f"marft vllm: {line}", file=sys.stderr, flush=True)


def _interrupt(*_) -> None:
    """SIGTERM (a service manager stopping us) ends vLLM's process group as Ctrl-C does."""
    raise KeyboardInterrupt
