"""tests/vllm run against one real vLLM server per session (float32, CPU), started from the vLLM
environment that ``make vllm`` builds; ``make test-vllm`` runs them with ``MARFT_VLLM_PYTHON`` set.

Without ``MARFT_VLLM_PYTHON`` (plain ``make test`` / ``pytest tests/``) this directory is not even
collected, so the main suite neither skips nor waits here. The figures the tests measure (vLLM's
startup, parity, hot-swap) are printed at the end of the run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from marft_bridge.serving.vllm.server import PYTHON_ENV

if not os.environ.get(PYTHON_ENV):
    collect_ignore_glob = ["test_*.py"]

sys.path.insert(0, str(Path(__file__).parent))  # vllm_stack, beside this file
from vllm_stack import BASE_NAME, KEY, build_base  # noqa: E402

FIGURES: dict[str, str] = {}
# vLLM's startup (≈ 3 min on two busy cores) and the base's fine-tuning land in the first test's setup.
SESSION_TIMEOUT_S = 1800


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.timeout(SESSION_TIMEOUT_S))


def pytest_terminal_summary(terminalreporter):
    if FIGURES:
        terminalreporter.section("vLLM figures measured in this run")
        for name, value in FIGURES.items():
            terminalreporter.write_line(f"{name}: {value}")


@pytest.fixture(scope="session")
def figures() -> dict[str, str]:
    return FIGURES


@pytest.fixture(scope="session")
def base_model(tmp_path_factory) -> Path:
    return build_base(tmp_path_factory.mktemp("vllm-base") / BASE_NAME)


@pytest.fixture(scope="session")
def registry(base_model, tmp_path_factory):
    """``alpha`` (q, v) and ``beta`` (every projection) for parity, each one current version."""
    from marft_bridge.serving import AdapterRegistry
    from marft_bridge.serving.fixtures import make_random_adapter

    tmp = tmp_path_factory.mktemp("vllm-registry")
    reg = AdapterRegistry(tmp / "registry")
    reg.publish("alpha", make_random_adapter(base_model, tmp / "alpha", seed=1, rank=8, scale=0.5), promote=True)
    reg.publish("beta", make_random_adapter(base_model, tmp / "beta", seed=2, rank=16, scale=0.3,
                                            target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj")), promote=True)
    return reg


@pytest.fixture(scope="session")
def vllm_server(base_model, registry, tmp_path_factory, figures):
    """One vLLM for the whole session: base + the registry's current adapters at startup, runtime
    LoRA loading, Hermes tool parsing, processed log-probs, float32."""
    from marft_bridge.serving import VLLMServer

    adapters = {agent: registry.path(agent) for agent in registry.agents()}
    server = VLLMServer(base_model, lora_modules=adapters, api_key=KEY, max_loras=4, max_lora_rank=16,
                        max_model_len=1024, log_path=tmp_path_factory.mktemp("vllm-log") / "vllm.log")
    with server:
        figures["vLLM startup (process start -> /health 200)"] = f"{server.startup_s:.0f} s"
        yield server


@pytest.fixture(scope="session")
def embedded(base_model, registry):
    """``marft serve`` on the same base and registry (our server, from this project's venv)."""
    from marft_bridge.serving import ServerProcess

    with ServerProcess(base_model, registry.root, api_key=KEY, extra_args=["--max-lora-rank", "16"]) as srv:
        yield srv


def http_client(server):
    import httpx

    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)


@pytest.fixture(scope="session")
def vllm_http(vllm_server):
    with http_client(vllm_server) as c:
        yield c


@pytest.fixture(scope="session")
def embedded_http(embedded):
    with http_client(embedded) as c:
        yield c
