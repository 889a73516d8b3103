"""Team releases on the session's real vLLM: a candidate release's adapters loaded through the vLLM
publisher under their ``agent@rN`` names beside the stable release's; a 2-agent LangGraph app
(``ChatOpenAI``) whose episodes are pinned per release (sticky by episode id) and never mixed within
an episode, even when the canary is promoted mid-episode; and the identity probe passes for the right
adapter and fails for a swapped one. vLLM reports no version, so each call is checked against a direct
forward of base + the release's adapter version (the log-probs vLLM sampled with)."""

from __future__ import annotations

from typing import TypedDict

import pytest

import marft_bridge as mb
from marft_bridge.release_names import in_canary
from marft_bridge.serving import AdapterRegistry, VLLMPublisher
from marft_bridge.serving.fixtures import DirectModel, make_random_adapter
from marft_bridge.serving.releases import ReleaseStore
from marft_bridge.store import TraceStore
from vllm_stack import KEY, processed_reference

AGENTS = ("rplanner", "rcoder")  # names no other tests/vllm module serves
TEMPERATURE = 1.0
TOL = 1e-4


@pytest.fixture(scope="module")
def rel_registry(base_model, tmp_path_factory):
    """rplanner and rcoder, v1 and v2 each (random rank-8 adapters whose outputs differ)."""
    tmp = tmp_path_factory.mktemp("vllm-releases")
    reg = AdapterRegistry(tmp / "registry")
    for i, agent in enumerate(AGENTS):
        for v in (1, 2):
            reg.publish(agent, make_random_adapter(base_model, tmp / f"{agent}{v}", seed=40 + 10 * i + v, rank=8,
                                                   scale=0.5))
    return reg


class S(TypedDict, total=False):
    q: str
    plan: str
    code: str


def two_agent_app(url: str, between=None):
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    def model(name):
        return ChatOpenAI(base_url=url, api_key=KEY, model=name, max_tokens=4, temperature=TEMPERATURE,
                          max_retries=0, logprobs=True, extra_body={"return_token_ids": True})  # token data

    planner, coder = model("rplanner"), model("rcoder")

    def plan(s):
        out = {"plan": planner.invoke(s["q"]).content}
        if between is not None:
            between()
        return out

    g = StateGraph(S)
    g.add_node("planner", plan)
    g.add_node("coder", lambda s: {"code": coder.invoke("code: " + s["plan"]).content})
    g.add_edge(START, "planner")
    g.add_edge("planner", "coder")
    g.add_edge("coder", END)
    return g.compile()


def sampled_from(ep, base_model, reg, versions: dict[str, int]) -> None:
    """Every llm call of ``ep`` was attributed to, and sampled by vLLM from, ``versions``."""
    calls = [a for a in ep.actions if a.kind == "llm"]
    assert [a.policy.name for a in calls] == list(AGENTS)  # graph nodes planner, coder
    for a in calls:
        name = a.policy.name
        assert a.policy.version == versions[name]
        ref = processed_reference(DirectModel(base_model, reg.path(name, versions[name])),
                                  a.observation.prompt_token_ids, a.output.token_ids, temperature=TEMPERATURE)
        assert max(abs(p - q) for p, q in zip(ref, a.output.logprobs)) <= TOL, (name, versions)


def test_canary_on_vllm_pins_each_episode_to_one_release(vllm_server, base_model, rel_registry, tmp_path):
    reg = rel_registry
    pub = VLLMPublisher(vllm_server.url, KEY)
    store = ReleaseStore(reg)
    stable = store.create({"rplanner": 1, "rcoder": 1})
    store.promote(stable.id, [pub])
    canary = store.create({"rplanner": 2, "rcoder": 2})
    store.start_canary(canary.id, 0.5, [pub])
    listed = vllm_server_models(vllm_server)
    assert {f"{a}@{r}" for a in AGENTS for r in (stable.id, canary.id)} <= listed, listed

    traces = TraceStore.open(tmp_path / "t.db")
    app = mb.instrument(two_agent_app(vllm_server.base_url), store=traces, registry=reg.root)
    ids = []
    for i in range(8):
        app.invoke({"q": f"task {i}"})
        ids.append(app.last_episode_id)
    traces.flush()
    sides = set()
    for eid in ids:
        ep = traces.get_episode(eid)
        assert ep.release == (canary.id if in_canary(eid, canary.id, 0.5) else stable.id)  # sticky: the id decides
        sides.add(ep.release)
        sampled_from(ep, base_model, reg, store.get(ep.release).versions)
    assert sides == {stable.id, canary.id}

    # The canary is promoted between an episode's two calls: that episode finishes on its release.
    promoted = []

    def promote_once():
        if not promoted:
            promoted.append(store.promote(canary.id, [pub]).id)

    mixed = mb.instrument(two_agent_app(vllm_server.base_url, between=promote_once), store=traces,
                          registry=reg.root)
    mixed.invoke({"q": "late"})
    traces.flush()
    ep = traces.get_episode(mixed.last_episode_id)
    assert promoted == [canary.id] and store.state().stable == canary.id
    sampled_from(ep, base_model, reg, store.get(ep.release).versions)
    # Without a canary, the plain names serve the new stable release.
    plain = mb.instrument(two_agent_app(vllm_server.base_url), store=traces, registry=reg.root)
    plain.invoke({"q": "after"})
    traces.flush()
    sampled_from(traces.get_episode(plain.last_episode_id), base_model, reg, {"rplanner": 2, "rcoder": 2})
    for a in (app, mixed, plain):
        mb.uninstrument(a)
    traces.close()


def vllm_server_models(server) -> set[str]:
    import httpx

    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    return {m["id"] for m in r.json()["data"]}


def test_probe_on_vllm_passes_the_right_adapter_and_fails_a_swapped_one(vllm_server, base_model, rel_registry):
    from marft_bridge.serving.probe import record_expected, verify_release

    reg = rel_registry
    pub = VLLMPublisher(vllm_server.url, KEY)
    store = ReleaseStore(reg)
    for agent in AGENTS:
        for v in (1, 2):
            record_expected(reg, agent, v, base_model, max_tokens=4)
    rel = store.create({"rplanner": 2, "rcoder": 1})
    store.promote(rel.id, [pub])
    ok = verify_release(store, rel.id, vllm_server.url, api_key=KEY)
    assert ok["ok"], ok
    # v1's weights served under rplanner's name (a swapped adapter): only rplanner fails.
    pub.load("rplanner", reg.path("rplanner", 1), version=2)
    bad = verify_release(store, rel.id, vllm_server.url, api_key=KEY)
    assert not bad["ok"] and not bad["agents"]["rplanner"]["ok"] and bad["agents"]["rcoder"]["ok"], bad
    assert "differ" in bad["agents"]["rplanner"]["reason"]
    assert store.state().probes[rel.id]["ok"] is False
    pub.load("rplanner", reg.path("rplanner", 2), version=2)  # served right again: the probe passes again
    assert verify_release(store, rel.id, vllm_server.url, api_key=KEY)["ok"]
