"""The demo's two-agent LangGraph app (the MARFT paper's MATH setup in miniature): a *planner* that
brackets the step to do first without computing ("4+(5*3)"), then a *solver* that computes following
the plan ("5*3=15,4+15=19"). Both are ``ChatOpenAI`` models pointed at an OpenAI-compatible server
(``marft serve``) with ``model`` set to the agent's adapter name, so each agent is served by its own
LoRA adapter.

Every request asks for log-probs and (``extra_body``) the sampled token ids, which the capture hooks
record as the behaviour policy's data for training. A run whose input carries ``seed`` sends it with
each request (planner ``seed``, solver ``seed + 1``), so the server samples it reproducibly; under
``marft fit`` the rollout's seed is used the same way.
"""

from __future__ import annotations

from typing import TypedDict

from . import task

DEFAULT_TEMPERATURE = 0.7
DEFAULT_MAX_TOKENS = 32


class DemoState(TypedDict, total=False):
    question: str  # "4+5*3"
    plan: str  # the planner's reply ("4+(5*3)"); for the single agent, the first line of its reply
    answer: str  # the solver's reply ("5*3=15,4+15=19"); task.reward(question, answer) checks it
    seed: int  # optional: the sampling seed of this run's requests


def _api_base(base_url: str) -> str:
    """Accept the server root or its ``/v1`` prefix."""
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def chat_model(base_url: str, model: str, *, api_key: str | None, temperature: float, max_tokens: int, timeout: float):
    """A ``ChatOpenAI`` for one agent, asking for log-probs and token ids."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=model,
        base_url=_api_base(base_url),
        # The local server needs no key for completions; never forward a real OpenAI key from the env.
        api_key=api_key or "EMPTY",
        temperature=temperature,
        max_tokens=max_tokens,
        logprobs=True,
        extra_body={"return_token_ids": True},
        timeout=timeout,
        max_retries=1,
    )


def build_app(
    base_url: str,
    api_key: str | None = None,
    planner_model: str = "planner",
    solver_model: str = "solver",
    temperature: float = DEFAULT_TEMPERATURE,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    timeout: float = 120.0,
):
    """The compiled planner → solver graph. Invoke with ``{"question": "4+5*3"}``; the final state
    holds ``question``, ``plan`` and ``answer``."""
    from langchain_core.runnables import RunnableConfig

    planner = chat_model(base_url, planner_model, api_key=api_key, temperature=temperature, max_tokens=max_tokens, timeout=timeout)
    solver = chat_model(base_url, solver_model, api_key=api_key, temperature=temperature, max_tokens=max_tokens, timeout=timeout)

    def plan(state: DemoState, config: RunnableConfig) -> DemoState:
        reply = planner.invoke(task.planner_messages(state["question"]), config, **_seed(state, 0))
        return {"plan": reply.content}

    def solve(state: DemoState, config: RunnableConfig) -> DemoState:
        reply = solver.invoke(task.solver_messages(state["question"], state["plan"]), config, **_seed(state, 1))
        return {"answer": reply.content}

    return _chain("planner_solver", [("planner", plan), ("solver", solve)])


def build_single_agent_app(
    base_url: str,
    api_key: str | None = None,
    model: str = "single",
    temperature: float = DEFAULT_TEMPERATURE,
    max_tokens: int = 48,
    timeout: float = 120.0,
):
    """The single-agent baseline: one node ``"agent"`` plans and computes in one reply (same state
    keys, same checker)."""
    from langchain_core.runnables import RunnableConfig

    agent = chat_model(base_url, model, api_key=api_key, temperature=temperature, max_tokens=max_tokens, timeout=timeout)

    def act(state: DemoState, config: RunnableConfig) -> DemoState:
        reply = agent.invoke(task.single_agent_messages(state["question"]), config, **_seed(state, 0))
        return {"plan": reply.content.split("\n", 1)[0], "answer": reply.content}

    return _chain("single_agent", [("agent", act)])


def _seed(state: DemoState, offset: int) -> dict:
    """The run's seed (its input's ``seed``, else the rollout seed ``marft fit`` set) plus ``offset``."""
    from ..fitting.endpoint import current_seed

    seed = state["seed"] if state.get("seed") is not None else current_seed()
    return {"seed": seed + offset} if seed is not None else {}


def _chain(name: str, nodes: list[tuple[str, object]]):
    """A compiled graph running ``nodes`` one after the other, START to END."""
    from langgraph.graph import END, START, StateGraph

    graph = StateGraph(DemoState)
    previous = START
    for node, fn in nodes:
        graph.add_node(node, fn)
        graph.add_edge(previous, node)
        previous = node
    graph.add_edge(previous, END)
    return graph.compile(name=name)
