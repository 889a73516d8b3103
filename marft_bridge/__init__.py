"""marft_bridge: capture multi-agent LLM apps as Flex-POMDP episodes, train per-agent LoRA adapters
with MARFT, and hot-swap them back into the running application.

Public names are resolved lazily so that ``import marft_bridge`` stays fast and pulls in neither
pydantic models nor any optional extra until they are used.
"""

from __future__ import annotations

from ._lazy import lazy_getattr
from ._moved import install as _install_moved

_install_moved()  # old module paths (one release, with a DeprecationWarning)


__version__ = "0.1.0"

_EXPORTS = {
    "SCHEMA_VERSION": "marft_bridge.schema",
    "Episode": "marft_bridge.schema",
    "Action": "marft_bridge.schema",
    "Reward": "marft_bridge.schema",
    "Message": "marft_bridge.schema",
    "Observation": "marft_bridge.schema",
    "Output": "marft_bridge.schema",
    "SamplingParams": "marft_bridge.schema",
    "Policy": "marft_bridge.schema",
    "MarftError": "marft_bridge.errors",
    "RecordError": "marft_bridge.errors",
    "RecordLimits": "marft_bridge.limits",
    "TraceStore": "marft_bridge.store",
    "episode": "marft_bridge.integrations.session",
    "instrument": "marft_bridge.integrations.langgraph",
    "uninstrument": "marft_bridge.integrations.langgraph",
    "capture": "marft_bridge.capture",
    "fit": "marft_bridge.fitting.loop",
    "Endpoint": "marft_bridge.fitting.endpoint",  # the package, callable as the capture block
}

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__ = lazy_getattr(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__
