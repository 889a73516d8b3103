"""Hot-swap on a real vLLM under load (the ``benchmarks/vllm_hotswap.py`` scenario): no failed
request, every response from a version live while it was in flight, corrupt and over-rank adapters
refused while the old version keeps serving; and the registry's promote through ``VLLMPublisher``
keeps the current version when vLLM refuses the new one."""

from __future__ import annotations

import pytest

from marft_bridge.serving import AdapterError, AdapterRegistry, VLLMPublisher
from marft_bridge.serving.fixtures import make_random_adapter
from marft_bridge.serving.vllm.hotswap import SWAPS, run_hotswap
from vllm_stack import KEY


@pytest.fixture(scope="module")
def swap_registry(base_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("swaps")
    reg = AdapterRegistry(tmp / "registry")
    for seed in range(SWAPS + 1):
        reg.publish("swapper", make_random_adapter(base_model, tmp / f"a{seed}", seed=10 + seed, rank=8, scale=1.0))
    over_rank = make_random_adapter(base_model, tmp / "rank32", seed=99, rank=32, scale=1.0)
    return reg, over_rank


def test_swaps_under_load_on_vllm(vllm_server, swap_registry, figures):
    reg, over_rank = swap_registry
    report = run_hotswap(vllm_server.url, reg, "swapper", api_key=KEY, over_rank_adapter=over_rank, clients=4,
                         requests=40, max_tokens=8)
    assert report.failures == []
    assert report.errors == [] and report.responses >= 160 and report.swaps == SWAPS
    assert report.served_versions == reg.versions("swapper")[-(SWAPS + 1):]  # every version served under load
    # vLLM answers both with a 500 from its worker's add_lora (see the README table).
    assert "HTTP 500" in report.refused["corrupt"] and "add_lora" in report.refused["corrupt"]
    assert "max_lora_rank" in report.refused["over-rank"]
    figures["hot-swap under load (4 clients, 5 swaps, each version live for 26 requests sent after its load)"] = report.summary()


def test_promote_keeps_the_current_version_when_vllm_refuses(vllm_server, swap_registry, tmp_path, vllm_http):
    reg, over_rank = swap_registry
    pub = VLLMPublisher(vllm_server.url, KEY)
    v_good = reg.versions("swapper")[0]
    reg.promote("swapper", v_good, publisher=pub)
    before = vllm_http.post("/v1/chat/completions", json={"model": "swapper", "max_tokens": 6, "temperature": 0,
                                                          "messages": [{"role": "user", "content": "x"}]}).json()
    v_bad = reg.publish("swapper", over_rank)  # the registry accepts rank 32; this vLLM does not
    with pytest.raises(AdapterError, match="HTTP 500.*greater than max_lora_rank"):
        reg.promote("swapper", v_bad, publisher=pub)
    assert reg.current("swapper") == v_good
    after = vllm_http.post("/v1/chat/completions", json={"model": "swapper", "max_tokens": 6, "temperature": 0,
                                                         "messages": [{"role": "user", "content": "x"}]}).json()
    assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
