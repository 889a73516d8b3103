"""Quickstart: capture a LangGraph app as Flex-POMDP episodes with one line.

    python examples/langgraph_quickstart.py                      # fake models, runs anywhere
    python examples/langgraph_quickstart.py --base-url http://127.0.0.1:8000/v1   # a real server
    marft traces show <episode id> --store .marft/quickstart.db

The app is an ordinary LangGraph graph: a planner, then a researcher and a coder in parallel,
then a reviewer. ``marft_bridge.instrument(app, store=...)`` is the only added line; each run
becomes one Episode whose actions carry agent, step, messages, output, sampling parameters,
adapter (model) name and the dependencies between agents. With ``--base-url`` every agent talks
to an OpenAI-compatible server with ``model=<agent>`` (vLLM multi-LoRA style); a vLLM-compatible
server that returns token ids and log-probs gets them stored exactly.
"""

from __future__ import annotations

import argparse
from typing import TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph

import marft_bridge as mb

AGENTS = ("planner", "researcher", "coder", "reviewer")


class State(TypedDict, total=False):
    task: str
    plan: str
    notes: str
    code: str
    review: str


def make_models(base_url: str | None) -> dict:
    if base_url:
        from langchain_openai import ChatOpenAI

        return {a: ChatOpenAI(model=a, base_url=base_url, api_key="local", temperature=0.7, max_tokens=128,
                              logprobs=True, extra_body={"return_token_ids": True}) for a in AGENTS}
    from langchain_core.language_models.fake_chat_models import FakeListChatModel

    canned = {
        "planner": "1. find the formula  2. write a function",
        "researcher": "The sum of 1..n is n*(n+1)/2.",
        "coder": "def total(n): return n * (n + 1) // 2",
        "reviewer": "APPROVED: matches the formula.",
    }
    # ls_model_name plays the served model's name (= the agent's adapter) for the fake models.
    return {a: FakeListChatModel(responses=[text], metadata={"ls_model_name": a}) for a, text in canned.items()}


def build_app(models: dict):
    def ask(agent: str, system: str, user: str) -> str:
        return models[agent].invoke([SystemMessage(system), HumanMessage(user)]).content

    def planner(s: State) -> State:
        return {"plan": ask("planner", "Plan the work in two steps.", s["task"])}

    def researcher(s: State) -> State:
        return {"notes": ask("researcher", "Find the facts the plan needs.", s["plan"])}

    def coder(s: State) -> State:
        return {"code": ask("coder", "Write the code for the plan.", s["plan"])}

    def reviewer(s: State) -> State:
        return {"review": ask("reviewer", "Approve or reject.", f"Notes: {s['notes']}\nCode: {s['code']}")}

    g = StateGraph(State)
    for name, fn in (("planner", planner), ("researcher", researcher), ("coder", coder), ("reviewer", reviewer)):
        g.add_node(name, fn)
    g.add_edge(START, "planner")
    g.add_edge("planner", "researcher")
    g.add_edge("planner", "coder")
    g.add_edge(["researcher", "coder"], "reviewer")
    g.add_edge("reviewer", END)
    return g.compile()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=".marft/quickstart.db", help="trace store URL or SQLite path")
    ap.add_argument("--base-url", help="an OpenAI-compatible server (default: fake models)")
    ap.add_argument("--runs", type=int, default=1, help="how many tasks to run (default 1)")
    args = ap.parse_args()

    store = mb.TraceStore.open(args.store)
    app = build_app(make_models(args.base_url))
    # The one added line: every run of `app` is now an Episode in `store`, rewarded by the checker.
    mb.instrument(app, store=store, reward_fn=lambda inputs, out: float(out["review"].startswith("APPROVED")))

    for i in range(args.runs):
        out = app.invoke({"task": f"Write total(n), the sum of 1..n (task {i + 1})."})
        print(f"review: {out['review']}")
        print(f"episode: {app.last_episode_id}")
    store.flush()
    print(f"\nshow it with:  marft traces show {app.last_episode_id} --store {args.store}")
    store.close()


if __name__ == "__main__":
    main()
