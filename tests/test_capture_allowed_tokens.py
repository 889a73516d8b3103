"""An app that constrains its agents' choices with vLLM's ``allowed_token_ids`` (in ``extra_body``):
capture records the set with the action's sampling parameters, beside the token ids and the
log-probs the real ``marft serve`` sampled them with, so the trainer can mask its log-probs alike."""

from __future__ import annotations

from typing import TypedDict

import pytest
import torch

import marft_bridge as mb
from test_serving import KEY, direct, registry, server  # noqa: F401 - fixture reuse


class S(TypedDict, total=False):
    q: str
    plan: str
    code: str


def constrained_graph(url: str, allowed: dict[str, list[int]]):
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph

    def model(name: str) -> ChatOpenAI:
        return ChatOpenAI(model=name, base_url=url, api_key=KEY, temperature=0.9, max_tokens=6, logprobs=True,
                          max_retries=0, extra_body={"return_token_ids": True, "allowed_token_ids": allowed[name]})

    planner, coder = model("planner"), model("coder")
    g = StateGraph(S)
    g.add_node("planner", lambda s: {"plan": planner.invoke(s["q"]).content})
    g.add_node("coder", lambda s: {"code": coder.invoke("Code this: " + s["plan"]).content})
    g.add_edge(START, "planner")
    g.add_edge("planner", "coder")
    g.add_edge("coder", END)
    return g.compile()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")


def test_allowed_token_ids_recorded_with_the_tokens_sampled_from_them(server, direct, sqlite_store):
    tok = direct["base"].tokenizer
    allowed = {"planner": tok.convert_tokens_to_ids(list("abc")), "coder": tok.convert_tokens_to_ids(list("xyz "))}
    app = mb.instrument(constrained_graph(server.base_url, allowed), store=sqlite_store)
    app.invoke({"q": "Plan: add 2 and 3."})
    sqlite_store.flush()
    ep = sqlite_store.get_episode(app.last_episode_id)
    assert [a.agent for a in ep.actions] == ["planner", "coder"]
    for a in ep.actions:
        assert a.sampling.allowed_token_ids == allowed[a.agent]
        assert a.token_source == "server" and set(a.output.token_ids) <= set(allowed[a.agent])
        # the recorded log-probs are the masked distribution's (mask, then temperature), as the server sampled
        lp = direct[a.agent].logprobs(a.observation.prompt_token_ids, a.output.token_ids, temperature=0.9)
        outside = torch.ones(lp.shape[-1], dtype=torch.bool)
        outside[allowed[a.agent]] = False
        masked = lp.masked_fill(outside, float("-inf")).log_softmax(-1)
        want = masked[torch.arange(len(a.output.token_ids)), torch.tensor(a.output.token_ids)]
        assert torch.allclose(torch.tensor(a.output.logprobs), want, atol=1e-4)
