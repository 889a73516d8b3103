"""vLLM as the serving back end: the managed server process (its own interpreter, reached over HTTP,
never imported here), the ``marft vllm`` command and the hot-swap-under-load scenario."""

from __future__ import annotations

from ..._lazy import lazy_getattr

_EXPORTS = {
    "VLLMServer": ".server",
    "vllm_python": ".server",
    "PYTHON_ENV": ".server",
    "STARTUP_TIMEOUT_S": ".server",
    "HotSwapReport": ".hotswap",
    "run_hotswap": ".hotswap",
    "SWAPS": ".hotswap",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
