"""Capture from vLLM: an instrumented LangGraph app whose ``ChatOpenAI`` agents point at a real vLLM
records, for every agent call, the prompt token ids, the sampled token ids and behaviour log-probs
equal to a direct forward pass of base + that agent's adapter (processed: temperature and top-k),
the dependency edge between the agents, and the adapter version read from the registry (vLLM
reports none)."""

from __future__ import annotations

from typing import TypedDict

import pytest

import marft_bridge as mb
from marft_bridge.serving.fixtures import DirectModel
from vllm_stack import KEY, processed_reference

TOL = 1e-4
TEMPERATURE, TOP_K, MAX_TOKENS = 0.8, 20, 16


class S(TypedDict, total=False):
    q: str
    plan: str
    answer: str


def two_agents(base_url: str, streaming: bool):
    """``alpha`` plans from ``q``; ``beta`` answers from the plan; each node calls its own adapter."""
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    def model(name: str, seed: int):
        return ChatOpenAI(model=name, base_url=base_url, api_key=KEY, temperature=TEMPERATURE, max_tokens=MAX_TOKENS,
                          logprobs=True, seed=seed, streaming=streaming, max_retries=0,
                          extra_body={"return_token_ids": True, "top_k": TOP_K})

    planner, answerer = model("alpha", 1), model("beta", 2)
    g = StateGraph(S)
    g.add_node("alpha", lambda s: {"plan": planner.invoke(s["q"]).content})
    g.add_node("beta", lambda s: {"answer": answerer.invoke(s["plan"]).content})
    g.add_edge(START, "alpha")
    g.add_edge("alpha", "beta")
    g.add_edge("beta", END)
    return g.compile()


@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "streaming"])
def test_langgraph_on_vllm_records_exact_tokens_and_logprobs(vllm_server, registry, base_model, sqlite_store,
                                                             streaming, figures):
    app = mb.instrument(two_agents(vllm_server.base_url, streaming), store=sqlite_store, registry=registry.root)
    out = app.invoke({"q": "Plan a trip to the sea."})
    sqlite_store.flush()
    ep = sqlite_store.get_episode(app.last_episode_id)
    alpha, beta = ep.actions
    assert [a.agent for a in ep.actions] == ["alpha", "beta"] and beta.depends_on == [alpha.id]
    assert (alpha.output.text, beta.output.text) == (out["plan"], out["answer"])
    gaps = []
    for action, user_text in ((alpha, "Plan a trip to the sea."), (beta, out["plan"])):
        direct = DirectModel(base_model, registry.path(action.agent))
        prompt = direct.chat_prompt([{"role": "user", "content": user_text}])
        assert action.observation.prompt_token_ids == prompt
        assert action.token_source == "server" and len(action.output.token_ids) > 0
        assert direct.tokenizer.decode(action.output.token_ids, skip_special_tokens=True) == action.output.text
        ref = processed_reference(direct, prompt, action.output.token_ids, temperature=TEMPERATURE, top_k=TOP_K)
        gaps.append(max(abs(p - q) for p, q in zip(ref, action.output.logprobs)))
        assert (action.policy.name, action.policy.version) == (action.agent, registry.current(action.agent))
        assert action.metadata["adapter_version_source"] == "registry"
        assert action.sampling.temperature == TEMPERATURE and action.sampling.top_k == TOP_K
    assert max(gaps) <= TOL, gaps
    figures[f"capture from vLLM ({'streamed' if streaming else 'invoke'}), behaviour log-probs vs direct forward"] = (
        f"max |Δ| {max(gaps):.2e} over {len(alpha.output.token_ids) + len(beta.output.token_ids)} sampled tokens")
