"""Old import paths of modules that moved into the wings (kept for one release, with a
``DeprecationWarning``): ``import marft_bridge.recording`` gives the module
``marft_bridge.capture.recording`` itself, so its state and monkeypatches are shared."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module -> its new home
MOVED = {
    "marft_bridge.recording": "marft_bridge.capture.recording",
    "marft_bridge.episode_context": "marft_bridge.capture.episode_context",
    "marft_bridge.messages": "marft_bridge.capture.messages",
    "marft_bridge.commands": "marft_bridge.service.cli",
    "marft_bridge.http_limits": "marft_bridge.serving.http.limits",
    "marft_bridge.tinymodel": "marft_bridge.demo.tinymodel",
    "marft_bridge.integrations.openai_streams": "marft_bridge.integrations.openai.streams",
    "marft_bridge.integrations.openai_agents_runs": "marft_bridge.integrations.openai_agents.runs",
    "marft_bridge.integrations.mcp_records": "marft_bridge.integrations.mcp.records",
    "marft_bridge.integrations.mcp_server": "marft_bridge.integrations.mcp.server",
    "marft_bridge.integrations.otel_emit": "marft_bridge.integrations.otel.emit",
    "marft_bridge.integrations.otel_messages": "marft_bridge.integrations.otel.messages",
    "marft_bridge.integrations.propagation": "marft_bridge.integrations.crossprocess.propagation",
    "marft_bridge.integrations.join_writer": "marft_bridge.integrations.crossprocess.join_writer",
    "marft_bridge.serving.server": "marft_bridge.serving.http.server",
    "marft_bridge.serving.routes": "marft_bridge.serving.http.routes",
    "marft_bridge.serving.request_parsing": "marft_bridge.serving.http.request_parsing",
    "marft_bridge.serving.requests": "marft_bridge.serving.http.requests",
    "marft_bridge.serving.responses": "marft_bridge.serving.http.responses",
    "marft_bridge.serving.api_errors": "marft_bridge.serving.http.errors",
    "marft_bridge.serving.generation": "marft_bridge.serving.http.generation",
    "marft_bridge.serving.tool_calls": "marft_bridge.serving.http.tool_calls",
    "marft_bridge.serving.engine_types": "marft_bridge.serving.engine.types",
    "marft_bridge.serving.batching": "marft_bridge.serving.engine.batching",
    "marft_bridge.serving.sampling": "marft_bridge.serving.engine.sampling",
    "marft_bridge.serving.adapter_slots": "marft_bridge.serving.engine.adapter_slots",
    "marft_bridge.serving.vllm_cli": "marft_bridge.serving.vllm.cli",
    "marft_bridge.serving.vllm_server": "marft_bridge.serving.vllm.server",
    "marft_bridge.serving.vllm_hotswap": "marft_bridge.serving.vllm.hotswap",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path as its new module (asked only after the normal finders fail)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes away next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
